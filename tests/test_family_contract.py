"""The decoding contract, checked for every record of the drafter-family registry
(``decode.families.FAMILIES``) with what the record loads without a source (random or untrained
weights on the tiny target): greedy speculative decoding equals AR token for token — under the
family's default plan and, where it offers trees, its first tree — and decoding over a
``data × tensor`` mesh emits the single-device tokens. A family added to the registry is checked here
without a line of its own; its own tests add what needs trained weights (the sampled chi-square, which
needs accepted drafts; export round trips; kill-and-resume of its training)."""

from __future__ import annotations

import jax
import pytest

from confu_jax.decode import families, generate, loop
from confu_jax.models.llama import init_params
from confu_jax.models.presets import get_preset
from confu_jax.models.registry import METHODS
from family_checks import assert_sharded_equals_single_device
from loop_fixtures import generated_rows

RECORDS = sorted(families.FAMILIES)
PROMPTS = [[5, 17, 3, 9, 2, 11, 40, 7], [1, 3, 1, 3, 2]]


@pytest.fixture(scope="module")
def target():
    cfg = get_preset("tiny")
    return cfg, init_params(cfg, jax.random.PRNGKey(0))


def _loaded(family: str, target):
    cfg, tp = target
    method = next(name for name, m in METHODS.items() if m.family == family)
    rec = families.FAMILIES[family]
    head = families.decode_head(method, cfg, tp, None, seed=1)
    limit = rec.max_depth(head.params) if rec.max_depth else None
    plans = [rec.default_plan(head.params)]
    for text in rec.trees:
        if limit is None or rec.parse(text).max_depth <= limit:
            plans.append(text)
            break
    return rec, head, plans


@pytest.mark.parametrize("family", RECORDS)
def test_greedy_equals_ar_for_every_family(family, target):
    cfg, tp = target
    rec, head, plans = _loaded(family, target)
    want = generated_rows(generate.generate_ar(tp, cfg, PROMPTS, max_new_tokens=12, eos_ids=()), len(PROMPTS))
    for text in plans:
        out = loop.generate_speculative(head.spec, head.params, rec.parse(text), PROMPTS, max_new_tokens=12,
                                        eos_ids=())
        assert generated_rows(out, len(PROMPTS)) == want, (family, text)


@pytest.mark.parametrize("family", RECORDS)
def test_sharded_equals_single_device_for_every_family(family, target):
    rec, head, plans = _loaded(family, target)
    assert_sharded_equals_single_device(head.spec, head.params, rec.parse(plans[0]), PROMPTS * 2,
                                        max_new_tokens=10, same_accepts=False)
