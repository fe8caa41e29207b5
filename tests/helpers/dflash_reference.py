"""DFlash's reference forward for the DFlash and JetSpec tests: the reference's ``DFlashDraftModel``
(z-lab/dflash ``dflash/model.py`` at 44947fbf71114e241c96de194f4b382b5dd330d0: ``Qwen3DFlashAttention`` with
the context K/V concatenated before the block's, ``Qwen3DFlashDecoderLayer``, ``fc`` -> ``hidden_norm``, final
``norm``) transcribed on transformers' Qwen3 modules, with the attention mask an argument (JetSpec's head,
hao-ai-lab/JetSpec ``jetspec/models/draft_head.py`` @2c7b3fa, is the same module under its causal mask), and
the tests' drafts with every term acting."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from confu_jax.models import dflash as D
from tests.helpers.jitting import jit_static
from tests.helpers.loop_fixtures import jit_propose, make, own

MASK = 3  # the mask token of the tests' drafts
init_dflash = jit_static(D.init_dflash)


def draft_for(dcfg, n_taps, seed=0, std=0.3):
    """A DFlash draft with every term acting: kernels large, norm scales perturbed."""
    p = jax.tree_util.tree_map(np.array, init_dflash(jax.random.PRNGKey(seed), dcfg, n_taps, init_std=std))
    rng = np.random.default_rng(seed + 1)
    for path, x in list(D._leaves(p).items()):
        if path.endswith("scale"):
            node = p
            *parents, leaf = path.split("/")
            for q in parents:
                node = node[q]
            node[leaf] = (1 + 0.3 * rng.standard_normal(x.shape)).astype(np.float32)
    return p


def setup(vocab, seed=0, n_layers=2, key="dflash", **kw):
    """(spec, target params, loop params) of a random target with a DFlash draft (``key`` 'jetspec': the same
    draft read as a JetSpec head)."""
    spec, tp, _ = make("eagle3", vocab, seed=seed, **kw)
    dcfg = D.draft_config(spec.target, n_layers, rope_theta=50000.0, rms_eps=1e-6)
    spec = dataclasses.replace(spec, draft_model=dcfg)
    p = draft_for(dcfg, len(spec.taps), seed=seed)
    return spec, tp, own(spec, tp, {key: {**p, "mask_token_id": np.int32(MASK % vocab)}})


def torch_reference(dcfg, n_taps, sd):
    """The reference's DFlashDraftModel.forward, transcribed on transformers' Qwen3 modules (float64, eager
    attention over [context ; block] with an explicit additive mask), loaded with strict=True."""
    import torch
    import torch.nn as nn
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

    hf = Qwen3Config(vocab_size=dcfg.vocab_size, hidden_size=dcfg.d_model, intermediate_size=dcfg.ffn_dim,
                     num_attention_heads=dcfg.n_heads, num_key_value_heads=dcfg.n_kv_heads, head_dim=dcfg.head_dim,
                     num_hidden_layers=dcfg.n_layers, rms_norm_eps=dcfg.rms_eps, rope_theta=dcfg.rope_theta,
                     max_position_embeddings=dcfg.max_position_embeddings, attention_bias=False)
    hd, hq, hkv = dcfg.head_dim, dcfg.n_heads, dcfg.n_kv_heads

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = nn.Linear(dcfg.d_model, hq * hd, bias=False)
            self.k_proj = nn.Linear(dcfg.d_model, hkv * hd, bias=False)
            self.v_proj = nn.Linear(dcfg.d_model, hkv * hd, bias=False)
            self.o_proj = nn.Linear(hq * hd, dcfg.d_model, bias=False)
            self.q_norm = Qwen3RMSNorm(hd, eps=hf.rms_norm_eps)
            self.k_norm = Qwen3RMSNorm(hd, eps=hf.rms_norm_eps)

        def forward(self, x, ctx, cos, sin, mask):
            b, q_len = x.shape[:2]
            c_len = ctx.shape[1]
            q = self.q_norm(self.q_proj(x).view(b, q_len, -1, hd)).transpose(1, 2)
            k = torch.cat([self.k_proj(ctx), self.k_proj(x)], 1).view(b, c_len + q_len, -1, hd)
            v = torch.cat([self.v_proj(ctx), self.v_proj(x)], 1).view(b, c_len + q_len, -1, hd).transpose(1, 2)
            k = self.k_norm(k).transpose(1, 2)
            cq, sq = cos[:, None, -q_len:], sin[:, None, -q_len:]  # the reference's apply_rotary_pos_emb
            q = q * cq + rotate_half(q) * sq
            k = k * cos[:, None] + rotate_half(k) * sin[:, None]
            k = k.repeat_interleave(hq // hkv, 1)
            v = v.repeat_interleave(hq // hkv, 1)
            s = q @ k.transpose(-1, -2) * hd ** -0.5 + mask[:, None]
            o = torch.softmax(s, -1) @ v
            return self.o_proj(o.transpose(1, 2).reshape(b, q_len, -1))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = Attn()
            self.mlp = Qwen3MLP(hf)
            self.input_layernorm = Qwen3RMSNorm(dcfg.d_model, eps=hf.rms_norm_eps)
            self.post_attention_layernorm = Qwen3RMSNorm(dcfg.d_model, eps=hf.rms_norm_eps)

        def forward(self, x, ctx, cos, sin, mask):
            x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, mask)
            return x + self.mlp(self.post_attention_layernorm(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Layer() for _ in range(dcfg.n_layers)])
            self.fc = nn.Linear(n_taps * dcfg.d_model, dcfg.d_model, bias=False)
            self.hidden_norm = Qwen3RMSNorm(dcfg.d_model, eps=hf.rms_norm_eps)
            self.norm = Qwen3RMSNorm(dcfg.d_model, eps=hf.rms_norm_eps)
            self.rotary_emb = Qwen3RotaryEmbedding(hf)

        def forward(self, position_ids, noise_embedding, target_hidden, mask):
            """mask [B, Q, C+Q] bool (True = visible)."""
            x = noise_embedding
            ctx = self.hidden_norm(self.fc(target_hidden))
            cos, sin = self.rotary_emb(x, position_ids)
            add = torch.where(mask, 0.0, float("-inf")).to(x.dtype)
            for layer in self.layers:
                x = layer(x, ctx, cos, sin, add)
            return self.norm(x)

    ref = Model().double()
    ref.load_state_dict({k: torch.from_numpy(np.asarray(v, np.float64)) for k, v in sd.items()}, strict=True)
    return ref


def first_block(spec, tp, params, drafter, prompt, key="dflash", causal=False):
    """(the loop's first proposal for ``prompt``, the root, the per-depth draft logits [K, V] of the
    reference's first block [root, M, ..., M] at positions n..n+K over the prompt's taps (every context slot
    visible; the block itself under :func:`models.dflash.block_self_mask`))."""
    from confu_jax.decode.drafter import DraftInput, PrefillView
    from confu_jax.models.target import real_forward

    p = D.model_params(params.drafter_params.weights[key])
    n, depth = len(prompt), drafter.max_depth
    toks = jnp.asarray([prompt], jnp.int32)
    out = jit_static(real_forward)(spec, tp, toks)
    root = jnp.argmax(out.logits_btv[:, -1], axis=-1).astype(jnp.int32)
    st = jax.jit(lambda target, dp: drafter.init(target, dp, PrefillView(toks, jnp.array([n]), root, out.taps_btc,
                                                                         None, 32)))(params.target,
                                                                                     params.drafter_params)
    inp = DraftInput(root, jnp.array([n - 1]), jnp.zeros((1,), bool), jax.random.PRNGKey(0), jnp.float32(0.0),
                     jnp.float32(1.0))
    prop = jit_propose(drafter, params.target, params.drafter_params, st, inp)
    k, v = jit_static(D.sequence_context)(p, spec.draft_model, out.taps_btc)
    blk = jnp.asarray([[int(root[0])] + [MASK] * depth])
    h = jit_static(D.block_hidden)(p, spec.draft_model, jit_static(D.embed_block)(tp, blk),
                                   jnp.arange(n, n + depth + 1)[None], D.block_self_mask(1, depth + 1, causal), k, v,
                                   jnp.array([n]))
    return prop, int(root[0]), np.asarray(jit_static(D.block_logits)(spec.target, tp, h))[0, 1:]
