"""The decoding contract, checked for every record of the drafter-family registry
(``decode.families.FAMILIES``) on one tiny target over a 6-token vocabulary, with what each record
loads without a source (random or untrained weights) and every float weight of the drafter then moved
by noise, so every term acts and — at six tokens — drafts are accepted, partly, on every row:

* greedy speculative decoding through the loop's public form — ``generate_speculative(target, drafter,
  drafter_params)``, with what the record's loader returns — equals AR token for token under every plan
  shape the family runs (its default plan, a chain where that is not one, a static tree, an EAGLE-2
  dynamic tree, DDTree's tree over a block draft where the family drafts blocks, its own first tree where
  that is another kind of plan), the accept log adds up to the tokens emitted, drafts were accepted,
  and with an EOS that falls inside a draft the rows stop where AR's do, for the same reason;
* decoding over a ``data × tensor`` mesh emits the single-device tokens with the same accept log.

What every family that trains must do is checked in ``test_family_training_contract.py``.

A family added to the registry is checked here without a line of its own; its own tests add what is
particular to it (reference implementations, the sampled chi-square, its published layout's names)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.decode import families, generate, loop
from confu_jax.decode.families import METHODS
from tests.helpers.family_checks import assert_sharded_equals_single_device
from tests.helpers.loop_fixtures import generated_rows, prompts_for
from tests.helpers.model_fakes import random_target

VOCAB = 6
PROMPTS = prompts_for(VOCAB)
RECORDS = sorted(families.FAMILIES)
# a chain is checked through the default plan where that is one (most families'), the sampled chain's
# greedy rule is the chain's (its sampled rule has the chi-square tests of test_spec_loop / each family)
SHAPES = ("chain:3", "tree:2,2,1", "dynamic:3,2,5", "ddtree:5,3")
NEW = 30


@pytest.fixture(autouse=True)
def _one_familys_programs_alive():
    """Drop the compiled programs after every test, not only after the module (tests/conftest.py): this file
    compiles every family's loop under every plan shape and on a 2x2 mesh, and with all of them alive jaxlib
    0.10.2 aborted (SIGABRT in ``compilation_cache.put_executable_and_time``) while writing a later family's
    sharded program to the persistent cache (hybrid's, in a full run under xdist, once DFlash2 and Domino joined). Each test's
    programs stay in the persistent cache, so a later test that needs one loads it."""
    yield
    jax.clear_caches()


@pytest.fixture(scope="module")
def target():
    return random_target(VOCAB, seed=0)


def _moved(tree, seed: int):
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda x: x + jnp.asarray(0.3 * rng.standard_normal(x.shape), x.dtype)
        if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _loaded(family: str, target):
    """(record, target, drafter params with moved weights, the plan texts the family runs)."""
    cfg, tp = target
    method = next(name for name, m in METHODS.items() if m.family == family)
    rec = families.FAMILIES[family]
    head = families.decode_head(method, cfg, tp, None, seed=1)
    dp = head.drafter_params
    assert (dp.verify_params is not None) == head.spec.has_future, family  # ConFu's extras: its one optional field
    dp = dp.replace(weights=_moved(dp.weights, 1), verify_params=_moved(dp.verify_params, 2))
    limit = rec.max_depth(head.drafter_params) if rec.max_depth else None
    plans = []
    default = rec.default_plan(head.drafter_params)
    for text in (default, *SHAPES, *rec.trees[:1]):
        try:
            depth = rec.parse(text).max_depth
        except ValueError:  # a shape this family does not draft
            continue
        if text not in plans and (limit is None or depth <= limit):
            plans.append(text)
    if any(not p.startswith("chain:") for p in plans) and default.startswith("chain:"):
        plans = [p for p in plans if p == default or not p.startswith("chain:")]  # one chain is enough
    # one plan of each kind: the family's own first tree where it is a kind the shapes above do not cover (a
    # second static or dynamic tree drafts through the same code as the first, at ~8 s a compile)
    kinds = [p.partition(":")[0] for p in plans]
    distinct = [p for i, p in enumerate(plans) if kinds[i] not in kinds[:i]]
    return rec, head.target, dp, distinct if len(distinct) >= 2 else plans


@pytest.mark.parametrize("family", RECORDS)
def test_greedy_equals_ar_for_every_family_and_plan_shape(family, target):
    cfg, tp = target
    rec, tgt, dp, plans = _loaded(family, target)
    assert len(plans) >= 2, (family, plans)
    ar = generate.generate_ar(tp, cfg, PROMPTS, max_new_tokens=NEW, eos_ids=())
    want = generated_rows(ar, len(PROMPTS))
    eos = want[0][11]  # inside a draft: rows stop at different times
    ar_eos = generate.generate_ar(tp, cfg, PROMPTS, max_new_tokens=NEW, eos_ids=(eos,))
    for text in plans:
        drafter = rec.parse(text)
        out = loop.generate_speculative(tgt, drafter, dp, PROMPTS, max_new_tokens=NEW, eos_ids=())
        assert generated_rows(out, len(PROMPTS)) == want, (family, text)
        log = np.asarray(out.accept_log_bi)
        assert np.array_equal(log.sum(1) + 1, np.asarray(out.n_generated_b)), (family, text)
        assert log.max() > 1, (family, text, "no draft accepted: the check would be vacuous")
        out = loop.generate_speculative(tgt, drafter, dp, PROMPTS, max_new_tokens=NEW, eos_ids=(eos,))
        assert generated_rows(out, len(PROMPTS)) == generated_rows(ar_eos, len(PROMPTS)), (family, text, "eos")
        assert np.array_equal(np.asarray(out.stop_reason_b), np.asarray(ar_eos.stop_reason_b)), (family, text)


# JetSpec's sharded check lives in tests/unit/test_jetspec.py: run here, before SD²'s in the same process,
# jaxlib 0.10.2 on CPU crashed (SIGSEGV in compilation_cache.put_executable_and_time) serialising SD²'s 8-device
# program, reproducibly under xdist; each passes alone. Its code path is DFlash's, checked here.
SHARDED = [f for f in RECORDS if f != "jetspec"]


@pytest.mark.slow
@pytest.mark.parametrize("family", SHARDED)
def test_sharded_equals_single_device_for_every_family(family, target):
    rec, tgt, dp, plans = _loaded(family, target)
    tree = next((p for p in plans if not p.startswith("chain:")), plans[0])  # a tree where the family has one
    # NEW, as the greedy test: its single-device program is the one compiled there (same module, same cache)
    assert_sharded_equals_single_device(tgt, dp, rec.parse(tree), PROMPTS, max_new_tokens=NEW)

