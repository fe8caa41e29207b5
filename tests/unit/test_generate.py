"""Jitted AR generation on the 'tiny' preset with random weights.

References are independent of the loop: full-sequence forwards of the same model (no cache), a
plain Python greedy loop over them, and ``sampling.target_probs`` for sampled tokens.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from confu_jax.decode import generate as gen
from confu_jax.decode import requests
from confu_jax.decode.stopping import PAD_OUT
from confu_jax.models.kv_cache import init_cache
from confu_jax.decode.stopping import StopReason
from confu_jax.decode.sampling import target_probs
from confu_jax.models.llama import Llama, init_params
from confu_jax.models.presets import get_preset
from confu_jax.models.unrolled import split_layers

CFG = get_preset("tiny")
REF_WIDTH = 64  # fixed width of the reference forward: causal, so right padding is inert


def _scaled_params(scale):
    p = init_params(CFG, jax.random.PRNGKey(0))
    p["embed"]["embedding"] = p["embed"]["embedding"] * scale
    return p


def _full_logits_fn(params):
    """f(seq) -> [V] logits after the last token of seq, from one full causal forward (no cache)."""
    fwd = jax.jit(lambda p, t: Llama(CFG).apply({"params": p}, t, jnp.arange(REF_WIDTH)[None]).logits_btv)

    def f(seq):
        assert len(seq) <= REF_WIDTH
        tok = np.zeros((1, REF_WIDTH), np.int32)
        tok[0, : len(seq)] = seq
        return np.asarray(fwd(params, jnp.asarray(tok))[0, len(seq) - 1])

    return f


# At init the (tied) logits are ~N(0, 0.16): greedy argmax would sit on near-ties. x8 puts argmax
# gaps far above float32 noise; x3 gives spread-out distributions for the sampling tests.
@pytest.fixture(scope="module")
def params():
    return _scaled_params(8.0)


@pytest.fixture(scope="module")
def full_logits(params):
    return _full_logits_fn(params)


@pytest.fixture(scope="module")
def sampling_params():
    return _scaled_params(3.0)


def greedy_reference(full_logits, prompt, n, eos_ids=()):
    seq, out = list(prompt), []
    for _ in range(n):
        t = int(np.argmax(full_logits(seq)))
        out.append(t)
        seq.append(t)
        if t in eos_ids:
            break
    return out


def prompts_of(lengths, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, CFG.vocab_size, size=n).tolist() for n in lengths]


def test_bucket_length():
    assert [requests.bucket_length(n) for n in (1, 16, 17, 32, 33, 100)] == [16, 16, 32, 32, 64, 128]
    assert requests.bucket_length(5, min_bucket=4) == 8
    with pytest.raises(ValueError, match="prompt length"):
        requests.bucket_length(0)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["scan", "unrolled"])
def test_prefill_then_incremental_decode_equals_full_forward(params, full_logits, schedule):
    if schedule == "unrolled":
        params = split_layers(params, CFG)
    prompts = prompts_of([5, 11])
    cont = [[7, 8, 9, 10, 11, 12], [40, 41, 42, 43, 44, 45]]  # teacher-forced continuations
    tokens_bt, lengths_b = requests.pad_prompts(prompts)
    cache = init_cache(CFG.n_layers, 2, 32, CFG.n_kv_heads, CFG.head_dim)
    logits_bv, cache = jax.jit(gen.prefill, static_argnums=1)(
        params, CFG, cache, jnp.asarray(tokens_bt), jnp.asarray(lengths_b))
    np.testing.assert_array_equal(np.asarray(cache.length_b), [5, 11])
    for b in range(2):
        np.testing.assert_allclose(np.asarray(logits_bv[b]), full_logits(prompts[b]), atol=2e-5, rtol=1e-5)
    step = jax.jit(gen.decode_step, static_argnums=1)
    for j in range(len(cont[0])):
        tok_b = jnp.asarray([cont[0][j], cont[1][j]], jnp.int32)
        logits_bv, cache = step(params, CFG, cache, tok_b, jnp.ones((2,), bool))
        for b in range(2):
            want = full_logits(prompts[b] + cont[b][: j + 1])
            np.testing.assert_allclose(np.asarray(logits_bv[b]), want, atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache.length_b), [11, 17])
    # an inactive row computes but does not commit
    _, cache2 = step(params, CFG, cache, jnp.asarray([1, 1], jnp.int32), jnp.asarray([True, False]))
    np.testing.assert_array_equal(np.asarray(cache2.length_b), [12, 17])
    np.testing.assert_array_equal(np.asarray(cache2.k_lbhsd[:, 1]), np.asarray(cache.k_lbhsd[:, 1]))


def test_greedy_equals_python_loop_of_full_forwards(params, full_logits):
    prompts = prompts_of([3, 7, 12])
    n = 20
    res = gen.generate_ar(params, CFG, prompts, max_new_tokens=n, eos_ids=())
    toks = np.asarray(res.tokens_bn)
    for b, p in enumerate(prompts):
        assert toks[b].tolist() == greedy_reference(full_logits, p, n), f"row {b}"
    np.testing.assert_array_equal(np.asarray(res.n_generated_b), [n] * 3)
    np.testing.assert_array_equal(np.asarray(res.stop_reason_b), [StopReason.MAX_NEW_TOKENS] * 3)
    # the padded-array form of the same prompts gives the same result
    tokens_bt, lengths_b = requests.pad_prompts(prompts, min_bucket=1)
    res2 = gen.generate_ar(params, CFG, tokens_bt, lengths=lengths_b, max_new_tokens=n, eos_ids=())
    np.testing.assert_array_equal(np.asarray(res2.tokens_bn), toks)


def test_eos_and_max_new_stop_per_row(params, full_logits):
    prompts = prompts_of([4, 9, 6], seed=3)
    n = 20  # same shapes as the greedy test, and EOS ids are traced: no new compile
    refs = [greedy_reference(full_logits, p, n) for p in prompts]
    # an EOS id that row 0 emits at index >= 1 and that some other row never emits
    eos = next(t for t in refs[0][1:] if any(t not in r for r in refs[1:]))
    res = gen.generate_ar(params, CFG, prompts, max_new_tokens=n, eos_ids=(eos,))
    toks, n_gen, why = (np.asarray(x) for x in res)
    saw_max_new = False
    for b, r in enumerate(refs):
        if eos in r:
            k = r.index(eos) + 1
            assert n_gen[b] == k and why[b] == StopReason.EOS, (b, n_gen[b], why[b])
        else:
            k = n
            saw_max_new = True
            assert n_gen[b] == n and why[b] == StopReason.MAX_NEW_TOKENS
        assert toks[b, :k].tolist() == r[:k]
        assert (toks[b, k:] == PAD_OUT).all()
    assert saw_max_new and why[0] == StopReason.EOS


def test_cache_full_stops_cleanly(params, full_logits):
    prompts = prompts_of([5, 2, 8], seed=4)
    max_len, n = 8, 20
    res = gen.generate_ar(params, CFG, prompts, max_new_tokens=n, eos_ids=(), max_len=max_len)
    toks, n_gen, why = (np.asarray(x) for x in res)
    # each fed token needs a slot: a P-token prompt leaves room for max_len - P + 1 emitted tokens
    np.testing.assert_array_equal(n_gen, [4, 7, 1])
    np.testing.assert_array_equal(why, [StopReason.CACHE_FULL] * 3)
    for b, p in enumerate(prompts):
        assert toks[b, : n_gen[b]].tolist() == greedy_reference(full_logits, p, int(n_gen[b]))
        assert (toks[b, n_gen[b]:] == PAD_OUT).all()
    # max_new_tokens reached on the same token as the cache fills: max_new takes priority
    res = gen.generate_ar(params, CFG, prompts[:1], max_new_tokens=4, eos_ids=(), max_len=max_len)
    assert int(res.n_generated_b[0]) == 4 and int(res.stop_reason_b[0]) == StopReason.MAX_NEW_TOKENS
    with pytest.raises(ValueError, match="cannot hold a prompt of 8 tokens"):
        gen.generate_ar(params, CFG, prompts, max_new_tokens=n, max_len=7)


def test_no_recompile_within_bucket_or_sampling_settings(params):
    n = 5  # a max_new_tokens no other test uses, so the first call below must trace
    c0 = gen.trace_count()
    gen.generate_ar(params, CFG, prompts_of([5, 3]), max_new_tokens=n)
    assert gen.trace_count() == c0 + 1
    gen.generate_ar(params, CFG, prompts_of([9, 16]), max_new_tokens=n)  # same bucket (16)
    gen.generate_ar(params, CFG, prompts_of([2, 7]), max_new_tokens=n, temperature=0.8, top_p=0.9, seed=3)
    assert gen.trace_count() == c0 + 1
    gen.generate_ar(params, CFG, prompts_of([17, 3]), max_new_tokens=n)  # bucket 32
    assert gen.trace_count() == c0 + 2


def _chi_square_p(counts, probs):
    """p-value of counts ~ Multinomial(probs); bins with expected count < 5 pooled."""
    total = counts.sum()
    exp = probs * total
    big = exp >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(exp[big], exp[~big].sum())
    keep = exp > 0
    return stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_sampling_matches_target_probs(sampling_params, temperature, top_p):
    params, full_logits = sampling_params, _full_logits_fn(sampling_params)
    prompt = prompts_of([6], seed=5)[0]
    batch = 4000
    res = gen.generate_ar(params, CFG, [prompt] * batch, max_new_tokens=2, eos_ids=(),
                          temperature=temperature, top_p=top_p, seed=11)
    toks = np.asarray(res.tokens_bn)
    # first token: sampled from the prefill logits
    p0 = np.asarray(target_probs(jnp.asarray(full_logits(prompt)), temperature, top_p))
    c0 = np.bincount(toks[:, 0], minlength=CFG.vocab_size)
    assert c0[p0 == 0].sum() == 0, "sampled a token outside the top-p nucleus"
    assert _chi_square_p(c0, p0) > 1e-3
    # second token, conditioned on the most frequent first token: sampled inside the while_loop
    mode = int(np.argmax(c0))
    rows = toks[:, 0] == mode
    p1 = np.asarray(target_probs(jnp.asarray(full_logits(prompt + [mode])), temperature, top_p))
    c1 = np.bincount(toks[rows, 1], minlength=CFG.vocab_size)
    assert rows.sum() > 300
    assert c1[p1 == 0].sum() == 0
    assert _chi_square_p(c1, p1) > 1e-3
    # same seed -> same samples; another seed -> different samples
    again = gen.generate_ar(params, CFG, [prompt] * batch, max_new_tokens=2, eos_ids=(),
                            temperature=temperature, top_p=top_p, seed=11)
    np.testing.assert_array_equal(np.asarray(again.tokens_bn), toks)
    other = gen.generate_ar(params, CFG, [prompt] * batch, max_new_tokens=2, eos_ids=(),
                            temperature=temperature, top_p=top_p, seed=12)
    assert (np.asarray(other.tokens_bn) != toks).any()
