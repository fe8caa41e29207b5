"""Continuous batching (decode.continuous): every row, refilled ones included, is exactly what
``generate_ar`` gives its prompt alone (greedy, and sampled with the same seed)."""

import jax
import numpy as np
import pytest

from confu_jax.decode.continuous import ContinuousGenerator
from confu_jax.decode.generate import generate_ar
from confu_jax.decode.stopping import StopReason
from confu_jax.models.llama import init_params
from confu_jax.models.presets import get_preset

CFG = get_preset("tiny")
MAX_LEN, N_NEW = 48, 10


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.PRNGKey(3))


def _prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(2, CFG.vocab_size, n).tolist() for n in (5, 17, 3, 9, 30, 1, 12)]


def _alone(params, prompt, eos, **kw):
    res = generate_ar(params, CFG, [prompt], max_new_tokens=N_NEW, max_len=MAX_LEN, eos_ids=eos, **kw)
    n = int(res.n_generated_b[0])
    return np.asarray(res.tokens_bn)[0, :n].tolist(), StopReason(int(res.stop_reason_b[0]))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_rows_equal_generate_ar_alone_refills_included(params, temperature):
    prompts = _prompts()
    # an EOS id that the greedy continuation of prompt 0 reaches early: rows stop at different steps
    eos = (_alone(params, prompts[0], ())[0][2],)
    gen = ContinuousGenerator(params, CFG, batch=3, max_len=MAX_LEN, max_new_tokens=N_NEW, eos_ids=eos,
                              temperature=temperature, top_p=0.95, steps_per_sync=4)
    got = {f.request_id: (f.tokens, f.reason) for f in gen.run((i, p, 100 + i) for i, p in enumerate(prompts))}
    assert sorted(got) == list(range(len(prompts)))  # 7 requests through 3 slots: refills happened
    reasons = set()
    for i, p in enumerate(prompts):
        want = _alone(params, p, eos, temperature=temperature, top_p=0.95, seed=100 + i)
        assert got[i] == want, (i, got[i], want)
        reasons.add(want[1])
    if temperature == 0.0:
        assert reasons == {StopReason.EOS, StopReason.MAX_NEW_TOKENS}
    assert gen.tokens_generated == sum(len(t) for t, _ in got.values())


def test_follow_up_requests_and_bad_prompts(params):
    prompts = _prompts()
    gen = ContinuousGenerator(params, CFG, batch=2, max_len=MAX_LEN, max_new_tokens=4, eos_ids=())
    queued = []
    seen = []

    def more():
        out, queued[:] = list(queued), []
        return out

    for f in gen.run([("a", prompts[0], 0), ("b", prompts[1], 0)], more=more):
        seen.append(f.request_id)
        if f.request_id == "a":  # a conversation's next turn, built from the answer just finished
            queued.append(("a2", prompts[0] + f.tokens, 0))
    assert sorted(seen) == ["a", "a2", "b"]
    with pytest.raises(ValueError, match="need 1 <= length < max_len=48"):
        list(gen.run([("x", [1] * 48, 0)]))
    with pytest.raises(ValueError, match="outside \\[0, 128\\)"):
        list(gen.run([("x", [1, 500], 0)]))
