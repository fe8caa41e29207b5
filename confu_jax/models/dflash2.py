"""DFlash2: DFlash with grouped dynamic convolutions and a candidate selector (z-lab; speculators 0.9).

References read for this transcription: speculators ``models/dflash2/`` (``DFlash2DraftModel``: ``core.py``,
``model_definitions.py`` ``grouped_dynamic_conv`` / ``GroupedDynamicCausalConv`` / ``CandidateSelector``,
``metrics.py`` ``selector_training_candidates``, ``config.py``; adapted there from z-lab/dflash ``dflash/model.py``
@07ebd93) and vLLM 0.32's ``model_executor/models/qwen3_dflash2.py`` + ``v1/worker/gpu/spec_decode/dflash2/
speculator.py`` (the serving walk: ``_score_edges``, ``_selector_walk_kernel``, ``_cache_draft_logits_kernel``).

Why a model of its own: the backbone is DFlash's, read the DFlash way (the block [x[p+1], M, ..., M], slot k >= 1
drafting x[p+1+k]), with two additions:

* **Grouped dynamic causal convolutions** around each layer's attention and MLP (``models.dflash.block_hidden``
  applies them when the layers hold ``attention_conv`` / ``mlp_conv``): from the sublayer's normed input h a
  projection draws two token-conditioned kernels δ [K, G]; the sublayer reads conv(h; base[0] + δ_in) and its
  output is conv(·; base[1] + δ_out) — out[t] = Σ_{τ<K} x[t−τ] ⊙ (base[τ] + δ[t, τ, group]) within the block.
  Initialised as identities, the backbone starts as DFlash's.
* **A candidate selector**: slot k's unary logits u_k (the target's LM head) give its top-K candidates; each
  candidate c is scored u_k[c] + ⟨P[prev] ⊙ W h_k, S[c]⟩ — P, S [V, r] the predecessor / successor codebooks, W
  [d, r] a projection of the slot's final-normed state, prev the token drafted at slot k−1 (the root for slot 1).
  Drafts walk left to right through these scores (vLLM's walk: argmax at T = 0, a Gumbel draw at T > 0), and the
  distribution a draft is drawn from — the rejection rule's q — is softmax(scores / T) over the K candidates, zero
  elsewhere (vLLM caches exactly these scores, −inf outside, as its ``draft_logits``).

Parameters (``DrafterParams.weights['dflash2']``): the DFlash tree with ``layers/{attention,mlp}_conv/
{base_kernel [L,2,K,d], kernel_projection [L,d,2·K·G]}`` plus ``selector`` {``predecessor_codebook`` [V,r],
``successor_codebook`` [V,r], ``hidden_projection`` [d,r]}; in a decode tree also ``mask_token_id`` and, trained,
``block_size`` (int32 scalars) and ``top_k`` (an int32 vector [K] of 0..K−1: K is its length, static under jit).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from confu_jax.models.dflash import DECODE_SCALARS, conv_setting, init_dflash
from confu_jax.models.llama import LlamaConfig
from confu_jax.models import top_k as top_k_lib

EXTRA = ("selector",)
SCALARS = DECODE_SCALARS + ("top_k",)


def backbone(params: dict) -> dict:
    """The DFlash tree (convolutions included) inside a DFlash2 tree (its selector and decode scalars dropped)."""
    return {k: v for k, v in params.items() if k not in EXTRA and k not in SCALARS}


def selector_rank(params: dict) -> int:
    return int(np.shape(params["selector"]["hidden_projection"])[1])


def init_dflash2(rng: jax.Array, dcfg: LlamaConfig, n_taps: int, vocab: int, *, kernel_size: int = 2,
                 group_size: int = 16, rank: int = 256, init_std: float = 0.02, param_dtype=jnp.float32) -> dict:
    """A DFlash2 draft: DFlash's initialisation with identity convolutions, the selector N(0, init_std)
    (speculators' ``CandidateSelector``: codebooks and projection at ``initializer_range``)."""
    if dcfg.d_model % group_size or kernel_size < 1 or rank < 1:
        raise ValueError(f"DFlash2: conv_group_size {group_size} must divide the width {dcfg.d_model}, "
                         f"conv_kernel_size ({kernel_size}) and selector_rank ({rank}) must be >= 1")
    k0, k1, k2, k3 = jax.random.split(rng, 4)
    p = dict(init_dflash(k0, dcfg, n_taps, init_std=init_std, param_dtype=param_dtype,
                         conv=(kernel_size, group_size)))

    def normal(k, shape):
        return (init_std * jax.random.normal(k, shape)).astype(param_dtype)

    p["selector"] = {"predecessor_codebook": normal(k1, (vocab, rank)), "successor_codebook": normal(k2, (vocab, rank)),
                     "hidden_projection": normal(k3, (dcfg.d_model, rank))}
    return p


def init_shapes(dcfg: LlamaConfig, n_taps: int, vocab: int, **kw) -> dict:
    """ShapeDtypeStructs of ``init_dflash2(..., **kw)`` (what a run's checkpoint or a published file holds)."""
    return jax.eval_shape(lambda: init_dflash2(jax.random.PRNGKey(0), dcfg, n_taps, vocab, **kw))


def top_k(params: dict) -> int:
    """K: the candidates a slot reranks (the length of the decode tree's ``top_k`` vector)."""
    return int(np.shape(params["top_k"])[0])


def conv(params: dict):
    """(conv_kernel_size, conv_group_size) of a DFlash2 tree."""
    return conv_setting(params)


def project(params: dict, hidden: jax.Array) -> jax.Array:
    """W h [..., r] (float32) of slots' final-normed states ``hidden`` [..., d]."""
    return hidden.astype(jnp.float32) @ params["selector"]["hidden_projection"].astype(jnp.float32)


def selector_context(params: dict, projected: jax.Array, prev: jax.Array) -> jax.Array:
    """P[prev] ⊙ W h [..., r] (float32; ``projected`` = :func:`project`): what a slot's state and its predecessor
    token give every candidate."""
    return jnp.take(params["selector"]["predecessor_codebook"], prev, axis=0).astype(jnp.float32) * projected


def candidate_scores(params: dict, unary_k: jax.Array, cand_k: jax.Array, context: jax.Array) -> jax.Array:
    """u[c] + ⟨context, S[c]⟩ [..., K] for candidates ``cand_k`` [..., K] whose unary logits are ``unary_k``."""
    succ = jnp.take(params["selector"]["successor_codebook"], cand_k, axis=0).astype(jnp.float32)
    return unary_k.astype(jnp.float32) + jnp.einsum("...r,...kr->...k", context, succ)


def top_candidates(unary_v: jax.Array, k: int):
    """(ids [..., K], unary logits [..., K]): the serving candidate set, the unary top-K."""
    vals, ids = top_k_lib.top_k(unary_v.astype(jnp.float32), k)  # one 2-D TopK (models.top_k says why)
    return ids, vals


def scores_to_logits(scores_k: jax.Array, cand_k: jax.Array, vocab: int) -> jax.Array:
    """Candidate scores as full-vocabulary logits [..., V]: the scores at the candidates, −inf elsewhere."""
    flat_s = scores_k.reshape(-1, scores_k.shape[-1])
    flat_c = cand_k.reshape(-1, cand_k.shape[-1])
    rows = jnp.arange(flat_s.shape[0])[:, None]
    out = jnp.full((flat_s.shape[0], vocab), -jnp.inf, jnp.float32).at[rows, flat_c].set(flat_s)
    return out.reshape(scores_k.shape[:-1] + (vocab,))


def training_candidates(cand_k: jax.Array, target: jax.Array):
    """speculators' ``selector_training_candidates``: the unary top-K with the target injected at rank K−1 where it
    is absent -> (candidates [..., K], the target's rank [...], whether the unary top-K held it [...])."""
    k = cand_k.shape[-1]
    match = cand_k == target[..., None]
    contains = jnp.any(match, -1)
    rank = jnp.where(contains, jnp.argmax(match, -1), k - 1)
    cand = cand_k.at[..., k - 1].set(jnp.where(contains, cand_k[..., k - 1], target))
    return cand, rank.astype(jnp.int32), contains
