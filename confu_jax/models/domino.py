"""Domino: DFlash's block backbone plus a small GRU that corrects the block's logits causally (arXiv 2605.29707).

Reference read for this transcription: SpecForge (sgl-project/SpecForge @a6b6b023)
``specforge/modeling/draft/domino.py`` (``DominoDraftModel``: ``_init_draft_head``, ``apply_logits_head``,
``_sample_draft_tokens``), its DFlash base ``specforge/modeling/draft/dflash.py`` and its objective
``specforge/algorithms/common/dflash_family_model.py`` ``OnlineDominoModel``; the published config
``configs/qwen3-8b-domino.json`` (``shift_label: true``, ``pure_draft_prefix_len: 1``, ``emb_dim`` 256,
``gru_hidden_dim`` 1024).

Why a model of its own: the backbone is DFlash's (``models.dflash``), read with ``shift_label`` — the block
[x[p+1], M, ..., M] at positions p+1..p+bs, slot k predicting the **next** token x[p+k+2] (the anchor slot drafts
too; a block of bs slots drafts bs−1 tokens at decode, as the reference's ``_sample_draft_tokens``). On top of
the base logits b_k (the target's LM head):

* a GRU (one layer, no biases; ``torch.nn.GRU``'s gates r, z, n) runs over the target's embeddings of the block's
  tokens — the root, then each draft: s_k = GRU(s_{k−1}, E[x_k]) from s_{−1} = 0, so s_k has read every token up to
  slot k's own;
* slots k >= ``pure_draft_prefix_len`` add embed_proj([h_k ; s_k]) = W2 · silu(W1 · [h_k ; s_k]) (W1 [d+H, e],
  W2 [e, V]) to b_k; earlier slots keep b_k.

So slot k's distribution depends on the tokens drafted before it and drafts are drawn left to right (DSpark's
shape, with the GRU's state carried from a node to its children).

Parameters (``DrafterParams.weights['domino']``): the DFlash tree plus ``gru`` {``w_ih`` [d, 3H], ``w_hh`` [H, 3H]}
(torch ``weight_ih_l0`` / ``weight_hh_l0`` transposed, gates in torch's order r, z, n) and ``embed_proj``
{``w1`` [d+H, e], ``w2`` [e, V]}; in a decode tree also ``mask_token_id``, ``prefix_len``
(``pure_draft_prefix_len``) and, trained, ``block_size`` (int32 scalars).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from confu_jax.models.dflash import DECODE_SCALARS, init_dflash
from confu_jax.models.llama import LlamaConfig

EXTRA = ("gru", "embed_proj")
SCALARS = DECODE_SCALARS + ("prefix_len",)


def backbone(params: dict) -> dict:
    """The DFlash tree inside a Domino tree (its GRU head and decode scalars dropped)."""
    return {k: v for k, v in params.items() if k not in EXTRA and k not in SCALARS}


def gru_width(params: dict) -> int:
    return int(np.shape(params["gru"]["w_hh"])[0])


def init_domino(rng: jax.Array, dcfg: LlamaConfig, n_taps: int, vocab: int, *, gru_hidden_dim: int = 1024,
                emb_dim: int = 256, init_std: float = 0.02, param_dtype=jnp.float32) -> dict:
    """A Domino draft: DFlash's initialisation, the GRU as torch initialises one (U(−1/√H, 1/√H)), the projection
    N(0, init_std) (HF ``initializer_range`` for ``nn.Linear``)."""
    if gru_hidden_dim < 1 or emb_dim < 1:
        raise ValueError(f"Domino: gru_hidden_dim ({gru_hidden_dim}) and emb_dim ({emb_dim}) must be >= 1")
    k0, k1, k2, k3, k4 = jax.random.split(rng, 5)
    d, hh = dcfg.d_model, int(gru_hidden_dim)
    p = dict(init_dflash(k0, dcfg, n_taps, init_std=init_std, param_dtype=param_dtype))
    bound = 1.0 / np.sqrt(hh)

    def uniform(k, shape):
        return jax.random.uniform(k, shape, jnp.float32, -bound, bound).astype(param_dtype)

    def normal(k, shape):
        return (init_std * jax.random.normal(k, shape)).astype(param_dtype)

    p["gru"] = {"w_ih": uniform(k1, (d, 3 * hh)), "w_hh": uniform(k2, (hh, 3 * hh))}
    p["embed_proj"] = {"w1": normal(k3, (d + hh, emb_dim)), "w2": normal(k4, (emb_dim, vocab))}
    return p


def init_shapes(dcfg: LlamaConfig, n_taps: int, vocab: int, **kw) -> dict:
    """ShapeDtypeStructs of ``init_domino(..., **kw)`` (what a run's checkpoint or a published file holds)."""
    return jax.eval_shape(lambda: init_domino(jax.random.PRNGKey(0), dcfg, n_taps, vocab, **kw))


def gru_step(params: dict, state: jax.Array, x: jax.Array) -> jax.Array:
    """One step of ``torch.nn.GRU`` without biases: the state [..., H] after reading ``x`` [..., d] (float32)."""
    f32 = jnp.float32
    g = params["gru"]
    hh = state.shape[-1]
    xi = x.astype(f32) @ g["w_ih"].astype(f32)
    hi = state.astype(f32) @ g["w_hh"].astype(f32)
    r = jax.nn.sigmoid(xi[..., :hh] + hi[..., :hh])
    z = jax.nn.sigmoid(xi[..., hh:2 * hh] + hi[..., hh:2 * hh])
    n = jnp.tanh(xi[..., 2 * hh:] + r * hi[..., 2 * hh:])
    return (1.0 - z) * n + z * state.astype(f32)


def correction(params: dict, hidden: jax.Array, state: jax.Array) -> jax.Array:
    """embed_proj([h ; s]) [..., V] (float32): what the GRU state adds to a slot's base logits."""
    e = params["embed_proj"]
    f32 = jnp.float32
    x = jnp.concatenate([hidden.astype(f32), state.astype(f32)], -1)
    return jax.nn.silu(x @ e["w1"].astype(f32)) @ e["w2"].astype(f32)


def block_logits(params: dict, base_bnkv: jax.Array, hidden_bnkd: jax.Array, emb_bnkd: jax.Array,
                 prefix_len: int) -> jax.Array:
    """Every slot's Domino logits [..., bs, V] under teacher forcing (training, tests): the GRU over the block's
    token embeddings ``emb_bnkd`` (slot k's own token), slots >= ``prefix_len`` corrected."""
    lead = emb_bnkd.shape[:-2]
    state = jnp.zeros(lead + (gru_width(params),), jnp.float32)
    out = []
    for k in range(emb_bnkd.shape[-2]):
        state = gru_step(params, state, emb_bnkd[..., k, :])
        base = base_bnkv[..., k, :].astype(jnp.float32)
        out.append(base + correction(params, hidden_bnkd[..., k, :], state) if k >= prefix_len else base)
    return jnp.stack(out, -2)
