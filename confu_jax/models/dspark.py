"""DSpark: DFlash's block backbone with a Markov logit bias and a confidence head (DeepSeek, arXiv 2607.05147).

References read for this transcription: speculators ``models/dspark/`` (``DSparkDraftModel``: ``core.py``,
``model_definitions.py`` ``MarkovHead`` / ``ConfidenceHead``, ``config.py``) and vLLM's
``model_executor/models/qwen3_dspark.py`` + ``v1/worker/gpu/spec_decode/dspark/speculator.py`` (the
sequential sampling) and ``adaptive_verification.py`` (the confidence's use).

Why a model of its own: the backbone is DFlash's (``models.dflash``: fc + hidden_norm over the target's taps as
context K/V, Qwen3 layers, final norm, the target's LM head), but the block is read the DSpark way
(``sample_from_anchor``): the block [x[p+1], M, ..., M] of B slots at positions p+1..p+B, slot k predicting the
**next** token x[p+k+2] — the anchor slot drafts too, B slots draft B tokens. On top of the base logits:

* **Markov head** (``markov``): ``w1`` [V, r] embeds the previous token of the block (slot k's: the token at its
  own position — the root for slot 0, the draft of slot k-1 after), ``w2`` [r, V] maps it to a logit bias:
  ``logits_k = base_k + bias_k``, so drafts are drawn left to right. Head types: ``vanilla``
  (bias = w2(e)), ``gated`` (bias = w2(σ(gate([h_k; e])) ⊙ e)), ``rnn`` (a recurrent state s over the block:
  g, c, o = joint([s; e; h_k]); s ← σ(g)⊙s + (1−σ(g))⊙tanh(c); bias = w2(tanh(o))), h_k the backbone's
  final-normed state at slot k. The type is read from the tree (``markov_gate`` / ``markov_rnn`` present).
* **Confidence head** (``confidence``): conf_k = σ(proj([h_k; e_k])) (or proj(h_k) without the Markov
  embedding): slot k's predicted acceptance probability; their running product is the draft's survival.

Parameters (``DrafterParams.weights['dspark']``): the DFlash tree (``models.dflash``) plus ``markov`` {``w1``, ``w2``},
optionally ``markov_gate`` {``kernel`` [d+r, r], ``bias`` [r]} or ``markov_rnn`` {``kernel`` [2r+d, 3r],
``bias`` [3r]}, optionally ``confidence`` {``kernel`` [d(+r), 1], ``bias`` [1]}; in a decode tree also
``mask_token_id`` and, trained, ``block_size`` (int32 scalars).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from confu_jax.models.dflash import DECODE_SCALARS, init_dflash
from confu_jax.models.llama import LlamaConfig

HEAD_TYPES = ("vanilla", "gated", "rnn")
EXTRA = ("markov", "markov_gate", "markov_rnn", "confidence")


def backbone(params: dict) -> dict:
    """The DFlash tree inside a DSpark tree (its heads and decode scalars dropped)."""
    return {k: v for k, v in params.items() if k not in EXTRA and k not in DECODE_SCALARS}


def head_type(params: dict) -> str:
    return "gated" if "markov_gate" in params else "rnn" if "markov_rnn" in params else "vanilla"


def markov_rank(params: dict) -> int:
    return int(np.shape(params["markov"]["w1"])[1])


def init_dspark(rng: jax.Array, dcfg: LlamaConfig, n_taps: int, vocab: int, *, rank: int = 256,
                kind: str = "vanilla", confidence: bool = True, confidence_with_markov: bool = True,
                init_std: float = 0.02, param_dtype=jnp.float32) -> dict:
    """A DSpark draft: DFlash's initialisation, ``w1`` ~ N(0, 0.01) as the reference's, the rest N(0, init_std)
    (the confidence bias 0)."""
    if kind not in HEAD_TYPES:
        raise ValueError(f"DSpark markov head type {kind!r}; expected one of {HEAD_TYPES}")
    if rank < 1:
        raise ValueError(f"DSpark markov rank must be >= 1, got {rank}")
    k0, k1, k2, k3, k4 = jax.random.split(rng, 5)
    d = dcfg.d_model
    p = dict(init_dflash(k0, dcfg, n_taps, init_std=init_std, param_dtype=param_dtype))

    def normal(k, shape, std):
        return (std * jax.random.normal(k, shape)).astype(param_dtype)

    p["markov"] = {"w1": normal(k1, (vocab, rank), 0.01), "w2": normal(k2, (rank, vocab), init_std)}
    if kind == "gated":
        p["markov_gate"] = {"kernel": normal(k3, (d + rank, rank), init_std), "bias": jnp.zeros((rank,), param_dtype)}
    elif kind == "rnn":
        p["markov_rnn"] = {"kernel": normal(k3, (2 * rank + d, 3 * rank), init_std),
                           "bias": jnp.zeros((3 * rank,), param_dtype)}
    if confidence:
        width = d + (rank if confidence_with_markov else 0)
        p["confidence"] = {"kernel": normal(k4, (width, 1), init_std), "bias": jnp.zeros((1,), param_dtype)}
    return p


def init_shapes(dcfg: LlamaConfig, n_taps: int, vocab: int, **kw) -> dict:
    """ShapeDtypeStructs of ``init_dspark(..., **kw)`` (what a run's checkpoint or a published file holds)."""
    return jax.eval_shape(lambda: init_dspark(jax.random.PRNGKey(0), dcfg, n_taps, vocab, **kw))


def prev_embedding(params: dict, tokens) -> jax.Array:
    """e = w1[previous token] [..., r]."""
    return jnp.take(params["markov"]["w1"], tokens, axis=0)


def markov_bias(params: dict, e: jax.Array, hidden: jax.Array, state: Optional[jax.Array] = None):
    """(logit bias [..., V], the recurrent state after this slot or None) for previous-token embeddings ``e``
    [..., r] at slots whose backbone states are ``hidden`` [..., d]; ``state`` [..., r]: the rnn's before it."""
    f32 = jnp.float32
    w2 = params["markov"]["w2"].astype(f32)
    e = e.astype(f32)
    if "markov_gate" in params:
        g = params["markov_gate"]
        gate = jax.nn.sigmoid(jnp.concatenate([hidden.astype(f32), e], -1) @ g["kernel"].astype(f32) + g["bias"])
        return (gate * e) @ w2, None
    if "markov_rnn" in params:
        j = params["markov_rnn"]
        s = jnp.zeros(e.shape, f32) if state is None else state.astype(f32)
        z = jnp.concatenate([s, e, hidden.astype(f32)], -1) @ j["kernel"].astype(f32) + j["bias"]
        gate_raw, cand_raw, out_raw = jnp.split(z, 3, axis=-1)
        gate = jax.nn.sigmoid(gate_raw)
        s = gate * s + (1.0 - gate) * jnp.tanh(cand_raw)
        return jnp.tanh(out_raw) @ w2, s
    return e @ w2, None


def confidence(params: dict, hidden: jax.Array, e: jax.Array) -> jax.Array:
    """σ(proj([h; e])) (or σ(proj(h)) for a head without the Markov input) [...]: the slot's acceptance estimate."""
    c = params["confidence"]
    x = hidden.astype(jnp.float32)
    if c["kernel"].shape[0] != x.shape[-1]:
        x = jnp.concatenate([x, e.astype(jnp.float32)], -1)
    return jax.nn.sigmoid((x @ c["kernel"].astype(jnp.float32))[..., 0] + c["bias"][0])
