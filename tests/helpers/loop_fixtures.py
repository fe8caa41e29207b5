"""The speculative loop's test fixtures, shared by the loop's and every drafter family's tests: a tiny
target with a random head (``make``), prompts, the loop's pieces under jit, and the exact-math
references of the sampling tests (the AR joint by enumeration, a pooled chi-square)."""

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from confu_jax.decode import loop
from confu_jax.decode.loaded import LoadedDrafter, head_weights
from confu_jax.decode.params import DrafterParams, Target
from confu_jax.decode.sampling import target_probs
from confu_jax.models.llama import Llama
from confu_jax.models.presets import get_preset
from confu_jax.models.spec import HeadConfig, ModelSpec
from confu_jax.models.vocab_map import identity_draft_vocab
from tests.helpers.model_fakes import tiny_params

PROMPTS = [[3, 5, 7, 2, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [4], [6, 6, 1, 0, 2, 3, 3]]


def make(variant, vocab, seed=0, head_kw=None, **target_kw):
    target = get_preset("tiny").replace(vocab_size=vocab, eos_token_ids=(), **target_kw)
    head = HeadConfig(variant=variant, draft_vocab_size=vocab, n_soft_prompts=4, n_expert=4,
                      expert_top_k=2, init_std=0.2, soft_prompt_init_std=1.0, **(head_kw or {}))
    spec = ModelSpec(target, head)
    tp, tr = tiny_params(spec, seed)
    return spec, tp, head_weights(target, tp, head, tr, identity_draft_vocab(vocab, vocab), False, "test")


def own(spec, tp, weights: dict, **kw) -> LoadedDrafter:
    """A family's own ``weights`` ({family: tree}) beside the tiny target ``tp``: the loop's two trees with
    ``spec``'s draft model and taps (``kw``: other ``DrafterParams`` fields)."""
    dp = DrafterParams(weights=weights, draft_vocab={}, draft_model=spec.draft_model, tap_layers=spec.tap_layers, **kw)
    return LoadedDrafter(Target(spec.target, tp), dp, False, "test")


def with_weights(loaded: LoadedDrafter, **weights) -> LoadedDrafter:
    """``loaded`` with entries of its drafter's weight tree replaced (or added)."""
    dp = loaded.drafter_params
    return loaded._replace(drafter_params=dp.replace(weights={**dp.weights, **weights}))


def prompts_for(vocab):
    return [[t % vocab for t in p] for p in PROMPTS]


# The loop's pieces under jit, for tests that step it by hand (the loop-vs-training and gate tests):
# run eagerly, each of their ~1000 primitives is an XLA compile of its own (~40 ms apiece on 2 cores).
jit_prefill = jax.jit(loop._prefill, static_argnums=(2,), static_argnames=("max_new_tokens", "max_len"))
jit_iteration = jax.jit(loop.iteration, static_argnums=(2, 3), static_argnames=("max_new_tokens", "max_len"))
jit_propose = jax.jit(lambda drafter, target, dp, state, inp: drafter.propose(target, dp, state, inp),
                      static_argnums=(0,))


def generated_rows(result, n_rows):
    toks = np.asarray(result.tokens_bn)
    n = np.asarray(result.n_generated_b)
    return [toks[b, : n[b]].tolist() for b in range(n_rows)]


def exact_joint(spec, tp, prompt, temperature, top_p, n_tok=3):
    """P(x1..x3 | prompt) by enumeration with full forwards of the target (no cache, no draft)."""
    v = spec.target.vocab_size
    model = Llama(spec.target)

    @jax.jit  # one program per prefix count (eagerly, every primitive of the forward compiles alone)
    def last_probs(params, arr):
        pos = jnp.broadcast_to(jnp.arange(arr.shape[1]), arr.shape)
        logits = model.apply({"params": params}, arr, pos).logits_btv[:, -1]
        return target_probs(logits, temperature, top_p)

    def probs_of(prefixes):
        return np.asarray(last_probs(tp, jnp.asarray(prefixes, jnp.int32)), np.float64)

    joint = {(): 1.0}
    for _ in range(n_tok):
        keys = list(joint)
        pr = probs_of([list(prompt) + list(k) for k in keys])
        joint = {k + (x,): joint[k] * pr[i, x] for i, k in enumerate(keys) for x in range(v)
                 if joint[k] * pr[i, x] > 0}
    return joint


def chi_square_pvalue(samples, joint, n):
    keys = sorted(joint)
    idx = {k: i for i, k in enumerate(keys)}
    obs = np.zeros(len(keys))
    for row in samples:
        obs[idx[tuple(row)]] += 1  # KeyError = a zero-probability sequence was emitted
    exp = np.array([joint[k] for k in keys])
    exp = exp / exp.sum() * n  # enumeration drops zero-probability branches; renormalise rounding
    big = exp >= 5
    o = np.append(obs[big], obs[~big].sum())
    e = np.append(exp[big], exp[~big].sum())
    if e[-1] == 0:
        o, e = o[:-1], e[:-1]
    return stats.chisquare(o, e).pvalue
