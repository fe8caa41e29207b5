"""Tree layout of a verification pass: ancestor masks, depths and the 2T block of ConFu.

Verification scores every node of a draft tree in one target forward; a node may only see its
ancestors, so the block mask is the tree's ancestor-or-self relation, and a node at depth k sits
at RoPE position p+1+k. ConFu appends one contemplate query after each node
([T nodes | T contemplates]); the layout below says what each of the 2T queries sees
(docs/DESIGN.md §3 for p and the root, §4 for the contemplate rules).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp



def ancestors_from_parents(parents_bt: jax.Array) -> jax.Array:
    """Ancestor-or-self mask [B,T,T] from parent indices [B,T] (-1 for a root; parent < child).

    ``anc[b, i, j]`` is True iff node j is node i or one of its ancestors.
    """
    b, t = parents_bt.shape
    eye = jnp.broadcast_to(jnp.eye(t, dtype=bool), (b, t, t))
    has_parent = parents_bt >= 0
    par = jnp.where(has_parent, parents_bt, 0)

    def body(_, anc):
        from_parent = jnp.take_along_axis(anc, par[:, :, None], axis=1)  # row of each node's parent
        return eye | (from_parent & has_parent[:, :, None])

    return jax.lax.fori_loop(0, t, body, eye)


def depth_from_ancestors(anc_btt: jax.Array) -> jax.Array:
    """Depth [B,T] (root 0) = number of strict ancestors."""
    return jnp.sum(anc_btt, axis=-1).astype(jnp.int32) - 1


def verification_layout(anc_btt: jax.Array, base_pos_b: jax.Array, depth_bt: Optional[jax.Array] = None,
                        con_nodes_bm: Optional[jax.Array] = None):
    """Positions, block mask and soft-prompt visibility of the verification block.

    Layout ``[T nodes | M contemplates]``; contemplate c belongs to node ``con_nodes_bm[:, c]``
    (default: M = T, contemplate i to node i; sparse contemplates pass M < T node indices).
    Node i at depth k has position base+k (base = p+1, the root/bonus position) and sees its
    ancestors and itself; a contemplate of node i has position base+k+1 and sees node i's
    ancestors, node i and itself (plus the soft prompts). Nodes never see contemplates; both see
    the whole cache. Returns (positions [B,T+M] int32, block_mask [B,T+M,T+M] bool,
    prefix_visible [B,T+M] bool).
    """
    b, t, _ = anc_btt.shape
    if depth_bt is None:
        depth_bt = depth_from_ancestors(anc_btt)
    node_pos = base_pos_b[:, None].astype(jnp.int32) + depth_bt.astype(jnp.int32)
    if con_nodes_bm is None:
        con_pos, con_anc = node_pos + 1, anc_btt
    else:
        con_nodes_bm = con_nodes_bm.astype(jnp.int32)
        con_pos = jnp.take_along_axis(node_pos, con_nodes_bm, axis=1) + 1
        con_anc = jnp.take_along_axis(anc_btt, con_nodes_bm[..., None], axis=1)  # [B,M,T]
    m = con_pos.shape[1]
    positions = jnp.concatenate([node_pos, con_pos], axis=1)
    top = jnp.concatenate([anc_btt, jnp.zeros((b, t, m), bool)], axis=2)
    bottom = jnp.concatenate([con_anc, jnp.broadcast_to(jnp.eye(m, dtype=bool), (b, m, m))], axis=2)
    mask = jnp.concatenate([top, bottom], axis=1)
    prefix_visible = jnp.concatenate([jnp.zeros((b, t), bool), jnp.ones((b, m), bool)], axis=1)
    return positions, mask, prefix_visible
