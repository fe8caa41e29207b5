"""Plain-forward references of the ConFu target wrapper's tests (target wrapper, sparse contemplates)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from confu_jax.models.llama import Llama
from confu_jax.kernels.attention_reference import AttendTo
from confu_jax.models.target import con_embedding, embed_tokens, real_forward

ATOL = 2e-5


def close(a, b, atol=ATOL):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=1e-5)


jit_real_forward = jax.jit(real_forward, static_argnums=0)


@functools.partial(jax.jit, static_argnums=0)
def plain_with_contemplate(spec, tp, confu, seqs, lens, con_src):
    """Plain causal forward of ``seqs[r, :lens[r]]`` followed (if con_src is given) by one
    contemplate token at index lens[r]; only that index sees the soft prompts."""
    r, width = seqs.shape
    emb = embed_tokens(spec, tp, seqs)
    kw = {}
    if con_src is not None:
        con = con_embedding(spec, confu, con_src)  # [R, d]
        is_con = jnp.arange(width)[None, :] == lens[:, None]
        emb = jnp.where(is_con[..., None], con[:, None].astype(emb.dtype), emb)
        kw = dict(attend=AttendTo(k_prefix=confu["soft_prompt_k_lphd"], v_prefix=confu["soft_prompt_v_lphd"],
                                  prefix_visible=is_con))
    pos = jnp.broadcast_to(jnp.arange(width), (r, width))
    return Llama(spec.target).apply({"params": tp}, None, pos, embeds_btd=emb, tap_layers=spec.taps, **kw)
