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


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("temperature,fill_rows", [(0.0, 1), (0.0, 4), (0.9, 2)])
def test_prefix_reuse_continues_sessions_in_their_slots(params, temperature, fill_rows):
    """Multi-turn sessions: each follow-up (the previous prompt + its answer + a new user turn)
    continues in its session's parked slot, prefilling only the tokens past the longest common
    prefix; every turn still equals ``generate_ar`` on its whole prompt alone. One session's
    follow-up changes a token inside the previous answer (a re-tokenisation that differs from what
    was fed): only the common prefix is reused. 4 sessions through 2 slots: a session that ended
    leaves its parked slot to a waiting session, whose fresh prefill ignores the stale cache."""
    rng = np.random.default_rng(1)
    users = {s: [rng.integers(2, CFG.vocab_size, n).tolist() for n in (6, 3, 4)] for s in "abcd"}
    n_turns = {"a": 3, "b": 2, "c": 3, "d": 1}
    gen = ContinuousGenerator(params, CFG, batch=2, max_len=MAX_LEN, max_new_tokens=N_NEW, eos_ids=(),
                              temperature=temperature, top_p=0.95, steps_per_sync=3, max_fill_rows=fill_rows)
    prompts, queued, want_reused = {}, [], [0]

    def request(s, turn, prompt):
        prompts[(s, turn)] = prompt
        return ((s, turn), prompt, 7 * turn + ord(s), s)

    def more():
        out, queued[:] = list(queued), []
        return out

    got = {}
    first = [request(s, 0, users[s][0]) for s in "abcd"]
    for f in gen.run(first, more=more):
        s, turn = f.request_id
        got[f.request_id] = f.tokens
        if turn + 1 < n_turns[s]:
            answer = list(f.tokens)
            if s == "c" and turn == 0:
                answer[4] = (answer[4] + 1) % CFG.vocab_size  # the context differs from what was fed
            prev = prompts[(s, turn)]
            prompt = prev + answer + users[s][turn + 1]
            fed = prev + f.tokens[:-1]
            want_reused[0] += min(next(i for i in range(len(prompt)) if i == len(fed) or fed[i] != prompt[i]),
                                  len(prompt) - 1)
            queued.append(request(s, turn + 1, prompt))
    assert sorted(got) == sorted(prompts)
    for key, prompt in prompts.items():
        want = _alone(params, prompt, (), temperature=temperature, top_p=0.95, seed=7 * key[1] + ord(key[0]))[0]
        assert got[key] == want, (key, got[key], want)
    assert gen.stats["reused_tokens"] == want_reused[0] > 0
    total = sum(len(p) for p in prompts.values())
    assert gen.stats["prefill_tokens"] == total - want_reused[0]
    if fill_rows > 1:
        assert gen.stats["fill_calls"] < gen.stats["fill_rows"]  # some fills prefilled two rows at once


@pytest.mark.slow
def test_reuse_prefix_off_prefills_every_prompt_whole(params):
    prompts = _prompts()[:3]
    gen = ContinuousGenerator(params, CFG, batch=2, max_len=MAX_LEN, max_new_tokens=4, eos_ids=(),
                              reuse_prefix=False)
    queued = []

    def more():
        out, queued[:] = list(queued), []
        return out

    got = {}
    for f in gen.run([(i, p, 0, i) for i, p in enumerate(prompts)], more=more):
        got[f.request_id] = f.tokens
        if isinstance(f.request_id, int):
            queued.append((("again", f.request_id), prompts[f.request_id] + f.tokens, 0, f.request_id))
    assert gen.stats["reused_tokens"] == 0
    assert gen.stats["prefill_tokens"] == sum(2 * len(p) + 4 for p in prompts)
    for i, p in enumerate(prompts):
        res = generate_ar(params, CFG, [p + got[i]], max_new_tokens=4, max_len=MAX_LEN, eos_ids=())
        assert got[("again", i)] == np.asarray(res.tokens_bn)[0].tolist()
