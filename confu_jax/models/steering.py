"""SD² steering (Steering pretrained Drafters during Speculative Decoding, §2 and Appendix A.4).

The verifier's three tapped hidden states at a position j — the EAGLE-3 taps h_cat[j] = [l, m, h]
(hidden states entering layers 2, L//2, L-3; ``models.target.VerifyOutput.h_cat_btc``) — give a
**steering vector** g = W_hml · h_cat[j] of the target's width d. In every layer l of the drafter
the SwiGLU MLP becomes

    down( silu(gate x) * (up x + W_s^l g) )

(``models.llama``'s ``mlp_bias_lbtf``: the bias W_s^l g per layer, added to the up projection
before the gate product). Initialisation (the paper's): W_hml such that g = h + m + l (three
stacked identities), W_s^l = 0 — an untrained steered drafter computes exactly the unsteered one.

Parameters (``{'w_hml': {'kernel': [3d, d]}, 'w_s': {'kernel': [L_d, d, F_d]}}``) live next to the
draft model's in ``DrafterParams.weights['steering']`` (decode) and in the trainable tree (training,
``train.sd2_task``). Decoding holds g fixed for a whole drafting round: it is computed from h_cat
at the last accepted node of the previous verification (the position whose logits gave the bonus
token), so the round's depth-i draft reads a steering vector i+1 positions old; training draws
that offset δ ~ U{1..k} per position (docs/DESIGN.md §11).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from confu_jax.models.llama import LlamaConfig


def init_steering(target_d: int, n_taps: int, draft: LlamaConfig, dtype=jnp.float32) -> dict:
    """W_hml = [I; I; ...] (g = the sum of the taps), W_s^l = 0 for every drafter layer."""
    eye = jnp.eye(target_d, dtype=dtype)
    return {"w_hml": {"kernel": jnp.concatenate([eye] * n_taps, axis=0)},
            "w_s": {"kernel": jnp.zeros((draft.n_layers, target_d, draft.ffn_dim), dtype)}}


def steering_shapes(target_d: int, n_taps: int, draft: LlamaConfig, dtype=jnp.float32) -> dict:
    return jax.eval_shape(lambda: init_steering(target_d, n_taps, draft, dtype))


def check_steering(steering: dict, c: int, draft: LlamaConfig) -> None:
    """Shapes of a steering tree against the taps' width c (= 3d) and the drafter."""
    try:
        w_hml, w_s = steering["w_hml"]["kernel"], steering["w_s"]["kernel"]
    except (KeyError, TypeError):
        raise ValueError(f"steering params must be {{'w_hml': {{'kernel'}}, 'w_s': {{'kernel'}}}}; got "
                         f"{jax.tree_util.tree_structure(steering)}") from None
    d = w_hml.shape[-1]
    if w_hml.shape != (c, d) or w_s.shape != (draft.n_layers, d, draft.ffn_dim):
        raise ValueError(f"steering params: W_hml {w_hml.shape} / W_s {w_s.shape}; expected ({c}, d) / "
                         f"({draft.n_layers}, d, {draft.ffn_dim}) for taps of width {c} and this drafter")


def steering_vector(steering: dict, h_cat_xc: jax.Array) -> jax.Array:
    """g = W_hml · h_cat ([..., 3d] -> [..., d], float32)."""
    w = steering["w_hml"]["kernel"]
    return jnp.einsum("...c,cd->...d", h_cat_xc.astype(jnp.float32), w.astype(jnp.float32))


def steering_bias(steering: dict, g_xd: jax.Array) -> jax.Array:
    """The per-layer MLP bias W_s^l g: g [B, d] -> [L, B, F]; g [B, T, d] -> [L, B, T, F]."""
    w = steering["w_s"]["kernel"]
    return jnp.einsum("...d,ldf->l...f", g_xd.astype(jnp.float32), w.astype(jnp.float32))


def bias_from_taps(steering: dict, h_cat_xc: jax.Array) -> jax.Array:
    """``steering_bias(steering_vector(h_cat))``."""
    return steering_bias(steering, steering_vector(steering, h_cat_xc))
