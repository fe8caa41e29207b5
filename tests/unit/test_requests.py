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


def test_the_default_cache_never_refuses_what_fits_the_context():
    """A 4.5k prompt on an 8k model sits in the 8k bucket: bucket + new tokens passes the context, the
    prompt's own need does not — the default cache is sized by the need; past the context the error
    names the knobs."""
    cfg = CFG.replace(max_position_embeddings=8192)
    prompt = [[1 + i % (CFG.vocab_size - 1) for i in range(4500)]]
    req = validate_request(cfg, prompt, max_new_tokens=256)
    assert req.tokens_bt.shape[1] == 8192 and req.max_len == 4500 + 256
    assert validate_request(cfg, [[1] * 100], max_new_tokens=256).max_len == 128 + 256  # one size per bucket
    with pytest.raises(ValueError, match=r"needs 8300 cache slots.*max_position_embeddings=8192.*max_new_tokens"):
        validate_request(cfg, [[1] * 8000], max_new_tokens=300)
    with pytest.raises(ValueError, match=r"--config.decode.max_len"):
        validate_request(cfg, prompt, max_new_tokens=16, max_len=9000)


def test_a_cache_narrower_than_the_prompt_bucket_decodes_as_a_wide_one():
    """Near the context the cache is narrower than the padded prefill (commits past its end drop): the
    AR tokens equal those of a cache of bucket + new tokens on the same model."""
    import jax

    from confu_jax.decode.generate import generate_ar
    from confu_jax.models.llama import init_params

    params = init_params(CFG, jax.random.PRNGKey(0))
    prompt = [[1 + (7 * i) % (CFG.vocab_size - 1) for i in range(40)]]  # bucket 64
    tight = CFG.replace(max_position_embeddings=48)
    got = generate_ar(params, tight, prompt, max_new_tokens=8, eos_ids=())
    want = generate_ar(params, CFG, prompt, max_new_tokens=8, eos_ids=(), max_len=64 + 8)
    assert np.asarray(got.tokens_bn).tolist() == np.asarray(want.tokens_bn).tolist()
