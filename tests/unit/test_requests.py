"""One request validator for AR and speculative decoding: the same checks, the same messages."""

import numpy as np
import pytest

from confu_jax.decode.drafting import HeadDrafter
from confu_jax.decode.generate import prepare_ar_inputs
from confu_jax.decode.loop import prepare_spec_inputs
from confu_jax.decode.plans import parse_plan
from confu_jax.decode.requests import validate_request
from confu_jax.models.presets import get_preset
from confu_jax.models.spec import HeadConfig, ModelSpec

CFG = get_preset("tiny")
SPEC = ModelSpec(CFG, HeadConfig(variant="eagle3", draft_vocab_size=CFG.vocab_size))


def _both(prompts, **kw):
    """Run a request through the AR and the speculative preparation; return what each raised."""
    out = []
    for prep in (lambda: prepare_ar_inputs(CFG, prompts, **kw),
                 lambda: prepare_spec_inputs(SPEC.target, HeadDrafter(parse_plan("chain:2")), prompts, **kw)):
        with pytest.raises(ValueError) as e:
            prep()
        out.append(str(e.value))
    return out


def test_both_paths_reject_the_same_bad_requests():
    v = CFG.vocab_size
    for msgs in (_both([[1, 2, v]]), _both([[1, -3]])):
        assert all("outside [0, 128)" in m for m in msgs), msgs
    assert all("eos_ids must be token ids >= 0" in m for m in _both([[1, 2]], eos_ids=(-1,)))
    assert all("top_p" in m for m in _both([[1, 2]], top_p=0.0))
    assert all("max_new_tokens must be >= 1" in m for m in _both([[1, 2]], max_new_tokens=0))
    assert all("max_position_embeddings" in m for m in _both([[1, 2]], max_len=CFG.max_position_embeddings + 1))


def test_cache_must_hold_the_prompt_plus_what_the_loop_needs_first():
    prompt = [[1] * 8]
    validate_request(CFG, prompt, max_len=8)  # AR: a prompt that fills the cache still emits one token
    with pytest.raises(ValueError, match="cannot hold a prompt of 8 tokens plus one verification of depth 2"):
        prepare_spec_inputs(SPEC.target, HeadDrafter(parse_plan("chain:2")), prompt, max_len=10)
    args, static = prepare_spec_inputs(SPEC.target, HeadDrafter(parse_plan("chain:2")), prompt, max_len=11)
    assert static["max_len"] == 11


def test_padded_array_input_is_checked_only_inside_each_row_length():
    arr = np.array([[5, 6, 999], [7, 8, 9]], np.int32)  # 999 lies in row 0's padding
    req = validate_request(CFG, arr, lengths=[2, 3], min_bucket=4)
    assert req.tokens_bt.shape == (2, 4) and req.lengths_b.tolist() == [2, 3]
    with pytest.raises(ValueError, match="prompt 0 has token ids outside"):
        validate_request(CFG, arr, lengths=[3, 3])
