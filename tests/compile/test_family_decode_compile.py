"""The compile lane, part 2: every drafter family's speculative loop compiled for a TPU (v5e) and an H100
(XLA:GPU, sm_90a) from this CPU host, with what the family's record loads (random weights, bf16 target: what
those chips run), and no CPU custom call in any of them. For the TPU, the default plan with the greedy rule
and a tree (or its second plan shape) with the sampled rule; for the H100, that sampled tree: the program
with the family's drafting and its q in it. The greedy rule's H100 loops (AR, a tree) are compiled in
``test_topologies.py``; an XLA:GPU compile costs ~11 s here against XLA:TPU's ~5, so the family's greedy
H100 program, whose drafting is the sampled one's, is left out. A family added to the registry is compiled
here without a line of its own."""

from __future__ import annotations

import pytest

from confu_jax.topology import use_compilers  # noqa: E402

use_compilers()  # .xla-compilers (README command 2) on the path
pytest.importorskip("libtpu", reason="the TPU compiler (requirements-compilers.txt in .xla-compilers)")
pytest.importorskip("jax_plugins.xla_cuda12", reason="the GPU compiler (requirements-compilers.txt in .xla-compilers)")

from confu_jax import topology as tp  # noqa: E402
from confu_jax.decode import families, tracing  # noqa: E402
from confu_jax.decode.families import METHODS  # noqa: E402
from tests.helpers.model_fakes import random_target  # noqa: E402

pytestmark = pytest.mark.slow
RECORDS = sorted(families.FAMILIES)
TOPOLOGIES = {"tpu": "v5e:2x2", "gpu": "h100:1"}


@pytest.fixture(scope="module")
def target():
    cfg, tp_ = random_target(64, seed=0)
    return cfg.replace(dtype="bfloat16"), tp_


def _plans(rec, dp, platform: str) -> list:
    """(plan text, temperature): the family's default plan greedy, then another shape sampled (the H100:
    the sampled one alone)."""
    default = rec.default_plan(dp)
    limit = rec.max_depth(dp) if rec.max_depth else None
    sampled = default
    for text in (*rec.trees[:1], "tree:2,2,1", "dynamic:3,2,5", "ddtree:5,3", "chain:2"):
        try:
            depth = rec.parse(text).max_depth
        except ValueError:
            continue
        if text != default and (limit is None or depth <= limit):
            sampled = text
            break
    return ([] if platform == "gpu" else [(default, 0.0)]) + [(sampled, 1.0)]


@pytest.mark.parametrize("platform", sorted(TOPOLOGIES))
@pytest.mark.parametrize("family", RECORDS)
def test_every_family_loop_compiles_for_tpu_and_h100(family, platform, target):
    cfg, tparams = target
    method = next(name for name, m in METHODS.items() if m.family == family)
    rec = families.FAMILIES[family]
    head = families.decode_head(method, cfg, tparams, None, seed=1)
    device = tp.get_topology(TOPOLOGIES[platform]).devices[0]
    for text, temperature in _plans(rec, head.drafter_params, platform):
        traced = tracing.trace_speculative(head.target, head.drafter_params, rec.parse(text), device,
                                           temperature=temperature)
        compiled = tracing.compile_traced({"speculative": traced}, platform)["speculative"]
        hlo = compiled.as_text()
        assert "confu_packed" not in hlo, (family, text)
        assert compiled.memory_analysis().argument_size_in_bytes > 0, (family, text)
