"""DFlash: a block-diffusion draft model conditioned on target features (Chen, Liang, Liu 2026,
"DFlash: Block Diffusion for Flash Speculative Decoding", arXiv:2602.06036).

Reference (read for this transcription): z-lab/dflash ``dflash/model.py`` at commit
44947fbf71114e241c96de194f4b382b5dd330d0 (``DFlashDraftModel``, ``Qwen3DFlashAttention``,
``Qwen3DFlashDecoderLayer``, ``build_target_layer_ids``, ``extract_context_feature``,
``dflash_generate``); the training objective is SpecForge's (sgl-project/SpecForge
``specforge/algorithms/common/dflash_family_model.py`` ``OnlineDFlashModel`` at commit
a6b6b0230009d15ec2a97a57384e6f53f0f96946, the reference's recipe is not published); vLLM's
tpu-inference ``tpu_inference/models/jax/qwen3_dflash.py`` (commit b8692ff0) is the same model in JAX.

Why a separate family: the draft drafts a **whole block in one forward**. Its input is the block
[x[p+1], M, M, ..., M] (the bonus token then ``K`` copies of the mask token M, embedded by the
target's frozen embedding) at positions p+1..p+K+1; block position k >= 1 predicts x[p+1+k] through
the target's LM head. Attention inside the block is **bidirectional**; every draft layer also
attends the **context**: the target's features of every committed position j <= p, injected as
extra K/V:

    c[j]      = hidden_norm( fc( [h_{l1}[j] ; ... ; h_{lm}[j]] ) )   # m target layers -> d
    layer i:  q = rope(q_norm(q_proj(n(x))))  over the block
              K = rope(k_norm(k_proj([c ; n(x)])))   V = v_proj([c ; n(x)])   # context, then block
              x = x + o_proj(attn(q, K, V));  x = x + mlp(post_norm(x))
    out       = norm(x);  logits = target.lm_head(out)

The context K/V are **not** normed by the layer's input norm (the reference projects c directly);
each draft layer is a Qwen3 decoder layer (Llama's plus a per-head RMS norm of q and k, ``q_norm``
/ ``k_norm``). h_l[j] is the target's hidden state after layer l (HF ``hidden_states[l + 1]``): the
hidden state **entering** layer l+1, i.e. this project's tap ``l + 1`` (``models.llama`` taps are
the states entering a layer). ``build_target_layer_ids`` picks the reference's default layers.

The decode form caches the context K/V per draft layer (the reference's ``past_key_values_draft``
cropped to ``start`` after each block: only the context stays): ``context_kv`` computes them for
newly accepted positions, ``block_hidden`` runs the block against the cache. The training form runs
many blocks of one row at once with the same function (``masked_attention``: each query block sees
the context slots before its anchor, within its conversation, and its own block).

Parameters (``DrafterParams.weights['dflash']``; kernels [in, out] as flax, torch ``Linear.weight`` is
[out, in]; layers stacked on a leading axis)::

    {'fc': {'kernel': [m*d, d]}, 'hidden_norm': {'scale': [d]}, 'norm': {'scale': [d]},
     'layers': {'attn_norm': {'scale': [L,d]}, 'q_proj': {'kernel': [L,d,Hq*hd]},
                'k_proj': {'kernel': [L,d,Hkv*hd]}, 'v_proj': {'kernel': [L,d,Hkv*hd]},
                'q_norm': {'scale': [L,hd]}, 'k_norm': {'scale': [L,hd]}, 'o_proj': {'kernel': [L,Hq*hd,d]},
                'mlp_norm': {'scale': [L,d]}, 'gate_proj'/'up_proj': {'kernel': [L,d,F]},
                'down_proj': {'kernel': [L,F,d]}}}

plus, in a decode tree, ``'mask_token_id'`` (an int32 scalar: M) and, for trained drafts,
``'block_size'`` (the block it was trained on, which bounds a plan's depth). The draft's width is the target's
(its block input is the target's embedding and its output goes to the target's LM head); its layer
count, heads, FFN width, RoPE and norm epsilon are its own ``LlamaConfig`` (``ModelSpec.draft_model``).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from confu_jax.kernels.attention_reference import AttendTo
from confu_jax.models.attention import masked_attention
from confu_jax.models.llama import LlamaConfig, apply_rope, linear, rms_norm, rope_cos_sin
from confu_jax.models.unrolled import shared_params, target_logits

CONV_NAMES = ("attention_conv", "mlp_conv")  # DFlash2's convolutions, inside "layers" (models.dflash2)
LAYER_NAMES = ("attn_norm", "q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "o_proj", "mlp_norm", "gate_proj",
               "up_proj", "down_proj")


# ----------------------------------------------------------------------------- configuration


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list:
    """The reference's default target layers (``dflash/model.py`` ``build_target_layer_ids``): the middle
    layer for a one-layer draft, else ``num_draft_layers`` layers spread evenly over [1, L-3]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + (i * span) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def taps_for_layer_ids(layer_ids) -> tuple:
    """The reference's ``target_layer_ids`` (outputs of layer l) as this project's taps (states entering l+1)."""
    return tuple(int(i) + 1 for i in layer_ids)


def default_taps(num_target_layers: int, n: int = 3) -> tuple:
    """The taps of the reference's default ``n`` target layers (3 unless a drafter says otherwise:
    z-lab's Qwen3-8B and LLaMA-3.1-8B drafters read 5)."""
    return taps_for_layer_ids(build_target_layer_ids(num_target_layers, n))


def layer_ids_for_taps(taps) -> list:
    return [int(t) - 1 for t in taps]


def draft_config(target: LlamaConfig, num_layers: int, **overrides) -> LlamaConfig:
    """The draft's LlamaConfig: the target's layer shape (the reference's published drafters copy the
    target's heads and FFN width) with ``num_layers`` layers; ``overrides`` (heads, ffn_dim, rope_theta,
    rms_eps, ...) as a published config.json sets them."""
    return target.replace(n_layers=int(num_layers), **overrides)


def param_shapes(dcfg: LlamaConfig, n_taps: int, conv=None) -> dict:
    """{'path/to/leaf': shape} of a DFlash draft (without ``mask_token_id``); ``conv`` = (taps K, group size):
    DFlash2's grouped dynamic convolutions around each layer's attention and MLP (``models.dflash2``)."""
    L, d, hq, hkv, hd, f = dcfg.n_layers, dcfg.d_model, dcfg.n_heads, dcfg.n_kv_heads, dcfg.head_dim, dcfg.ffn_dim
    out = {"fc/kernel": (n_taps * d, d), "hidden_norm/scale": (d,), "norm/scale": (d,)}
    layer = {"attn_norm/scale": (d,), "q_proj/kernel": (d, hq * hd), "k_proj/kernel": (d, hkv * hd),
             "v_proj/kernel": (d, hkv * hd), "q_norm/scale": (hd,), "k_norm/scale": (hd,),
             "o_proj/kernel": (hq * hd, d), "mlp_norm/scale": (d,), "gate_proj/kernel": (d, f),
             "up_proj/kernel": (d, f), "down_proj/kernel": (f, d)}
    if conv is not None:
        k, g = int(conv[0]), d // int(conv[1])
        for side in CONV_NAMES:
            layer[f"{side}/base_kernel"] = (2, k, d)
            layer[f"{side}/kernel_projection"] = (d, 2 * k * g)
    out.update({f"layers/{k}": (L,) + s for k, s in layer.items()})
    return out


def conv_setting(params: dict):
    """(K, group size) of the grouped dynamic convolutions a draft tree holds (DFlash2), or None (DFlash)."""
    conv = params.get("layers", {}).get(CONV_NAMES[0])
    if conv is None:
        return None
    _, _, k, d = np.shape(conv["base_kernel"])
    return int(k), d // (int(np.shape(conv["kernel_projection"])[-1]) // (2 * int(k)))


def _leaves(params: dict) -> dict:
    return {"/".join(str(k.key) for k in path): x for path, x in jax.tree_util.tree_leaves_with_path(params)}


def _tree(flat: dict) -> dict:
    out: dict = {}
    for path, x in flat.items():
        node = out
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = x
    return out


# the int32 scalars a decode tree carries beside the draft's floats: the block's mask token, and the
# block size the draft was trained on (absent for an initialisation: no limit)
DECODE_SCALARS = ("mask_token_id", "block_size")


def model_params(params: dict) -> dict:
    """The float tree of a decode tree (``DECODE_SCALARS`` dropped)."""
    return {k: v for k, v in params.items() if k not in DECODE_SCALARS}


def check_dflash_params(params: dict, dcfg: LlamaConfig, n_taps: int, conv=None) -> None:
    """Raise unless ``params`` (``DECODE_SCALARS`` aside) is exactly a DFlash draft of ``dcfg`` reading
    ``n_taps`` target layers (with DFlash2's convolutions of setting ``conv``, when given)."""
    want = param_shapes(dcfg, n_taps, conv)
    got = {k: tuple(np.shape(v)) for k, v in _leaves(model_params(params)).items()}
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    bad = {k: (got[k], want[k]) for k in set(want) & set(got) if got[k] != want[k]}
    if missing or extra or bad:
        raise ValueError(f"DFlash params do not fit the draft config ({dcfg.n_layers} layers, d={dcfg.d_model}, "
                         f"heads {dcfg.n_heads}/{dcfg.n_kv_heads} x {dcfg.head_dim}, ffn {dcfg.ffn_dim}, "
                         f"{n_taps} target layers): missing {missing}, unexpected {extra}, shape (got, expected) {bad}")


def trainable_shapes(dcfg: LlamaConfig, n_taps: int, dtype=np.float32, conv=None) -> dict:
    """ShapeDtypeStructs of a DFlash draft (what a run's checkpoint holds)."""
    return _tree({k: jax.ShapeDtypeStruct(s, dtype) for k, s in param_shapes(dcfg, n_taps, conv).items()})


def init_dflash(rng: jax.Array, dcfg: LlamaConfig, n_taps: int, *, init_std: float = 0.02,
                param_dtype=jnp.float32, conv=None) -> dict:
    """An untrained draft: every kernel N(0, init_std) (HF ``initializer_range``, the reference's
    ``post_init``), every norm scale 1; DFlash2's convolutions (``conv``) as identities (base kernel 1 at tap 0,
    0 elsewhere, a zero kernel projection: speculators' ``reset_parameters``), so an initialised DFlash2 backbone
    is DFlash's."""
    shapes = param_shapes(dcfg, n_taps, conv)
    keys = iter(jax.random.split(rng, len(shapes)))
    flat = {}
    for path, shape in shapes.items():
        key = next(keys)
        if path.endswith("base_kernel"):
            flat[path] = jnp.zeros(shape, param_dtype).at[:, :, 0].set(1.0)
        elif path.endswith("kernel_projection"):
            flat[path] = jnp.zeros(shape, param_dtype)
        else:
            flat[path] = (jnp.ones(shape, param_dtype) if path.endswith("scale")
                          else (init_std * jax.random.normal(key, shape)).astype(param_dtype))
    return _tree(flat)


# ----------------------------------------------------------------------------- the forward


def _layer(p: dict, i: int) -> dict:
    return jax.tree_util.tree_map(lambda x: x[i], p["layers"])


def embed_block(target_params, tokens_bt) -> jax.Array:
    """The target's (frozen) embeddings of the block tokens (the reference's ``noise_embedding``)."""
    return jnp.take(jax.lax.stop_gradient(shared_params(target_params)["embed"]["embedding"]), tokens_bt, axis=0)


def context_features(p: dict, dcfg: LlamaConfig, taps_btc: jax.Array) -> jax.Array:
    """c = hidden_norm(fc(taps)) [B,S,d]: the fused target features every layer reads as K/V."""
    cd = jnp.dtype(dcfg.dtype)
    return rms_norm(linear(taps_btc, p["fc"]["kernel"], cd), p["hidden_norm"]["scale"], dcfg.rms_eps)


def _kv(lp: dict, dcfg: LlamaConfig, x_btd, cos, sin):
    cd = jnp.dtype(dcfg.dtype)
    b, t, _ = x_btd.shape
    k = linear(x_btd, lp["k_proj"]["kernel"], cd).reshape(b, t, dcfg.n_kv_heads, dcfg.head_dim)
    v = linear(x_btd, lp["v_proj"]["kernel"], cd).reshape(b, t, dcfg.n_kv_heads, dcfg.head_dim)
    return apply_rope(rms_norm(k, lp["k_norm"]["scale"], dcfg.rms_eps), cos, sin), v


def context_kv(p: dict, dcfg: LlamaConfig, ctx_btd: jax.Array, positions_bt: jax.Array):
    """Every layer's post-norm, post-RoPE K and V of context features ``ctx_btd`` at ``positions_bt``
    -> (k, v) [L,B,T,Hkv,hd] (``kv_cache.commit``'s token-major form)."""
    cos, sin = rope_cos_sin(positions_bt.astype(jnp.int32), dcfg)
    ks, vs = zip(*(_kv(_layer(p, i), dcfg, ctx_btd, cos, sin) for i in range(dcfg.n_layers)))
    return jnp.stack(ks), jnp.stack(vs)


def grouped_dynamic_conv(x_btd: jax.Array, delta_btkg: jax.Array, base_kd: jax.Array, block_len: int) -> jax.Array:
    """DFlash2's causal convolution inside each block of ``block_len`` along T (speculators
    ``models/dflash2/model_definitions.py`` ``grouped_dynamic_conv``): out[t] = Σ_τ x[t−τ] ⊙ (base[τ] +
    δ[t, τ, group]) over taps τ < K with t−τ in t's block; the token-conditioned δ is shared by the channels
    of a group (d / G each)."""
    t, d = x_btd.shape[1], x_btd.shape[2]
    k, g = base_kd.shape[0], delta_btkg.shape[-1]
    slot = jnp.arange(t) % block_len
    out = jnp.zeros_like(x_btd)
    for tap in range(k):
        shifted = x_btd if tap == 0 else jnp.pad(x_btd, ((0, 0), (tap, 0), (0, 0)))[:, :t]
        coef = base_kd[tap].astype(x_btd.dtype) + jnp.repeat(delta_btkg[:, :, tap, :].astype(x_btd.dtype), d // g, -1)
        out = out + jnp.where((slot >= tap)[None, :, None], shifted * coef, 0)
    return out


def _conv_kernels(cp: dict, h_btd: jax.Array, cd):
    """The two dynamic kernels (input side, output side) [B,T,K,G] a conv draws from a sublayer's input."""
    b, t, _ = h_btd.shape
    k = cp["base_kernel"].shape[1]
    z = linear(h_btd, cp["kernel_projection"], cd).reshape(b, t, 2, k, -1)
    return z[:, :, 0], z[:, :, 1]


def block_hidden(p: dict, dcfg: LlamaConfig, noise_btd: jax.Array, positions_bt: jax.Array,
                 block_mask_btt: jax.Array, ctx_k_lbhsd, ctx_v_lbhsd, ctx_len_bt, ctx_start_bt=None,
                 block_len: Optional[int] = None) -> jax.Array:
    """The draft over query blocks ``noise_btd`` [B,T,d] at ``positions_bt``: query t sees the block keys
    under ``block_mask_btt`` and context slots [ctx_start, ctx_len) of the per-layer context K/V
    (``ctx_k_lbhsd`` [L,B,Hkv,S,hd], head-major like ``kv_cache``; a stacked array or per-layer list)
    -> norm(x) [B,T,d], what the target's LM head reads. A DFlash2 tree (convolutions in its layers)
    convolves each sublayer's input and output within blocks of ``block_len`` along T (None: T is one block)."""
    cd = jnp.dtype(dcfg.dtype)
    b, t, _ = noise_btd.shape
    cos, sin = rope_cos_sin(positions_bt.astype(jnp.int32), dcfg)
    x = noise_btd.astype(cd)
    blk = t if block_len is None else int(block_len)

    def around(lp, name, h, sublayer):  # DFlash2: conv(input) -> sublayer -> conv(output); DFlash: the sublayer
        if name not in lp:
            return sublayer(h)
        d_in, d_out = _conv_kernels(lp[name], h, cd)
        out = sublayer(grouped_dynamic_conv(h, d_in, lp[name]["base_kernel"][0], blk))
        return grouped_dynamic_conv(out, d_out, lp[name]["base_kernel"][1], blk)

    for i in range(dcfg.n_layers):
        lp = _layer(p, i)

        def attention(h):
            q = linear(h, lp["q_proj"]["kernel"], cd).reshape(b, t, dcfg.n_heads, dcfg.head_dim)
            q = apply_rope(rms_norm(q, lp["q_norm"]["scale"], dcfg.rms_eps), cos, sin)
            k, v = _kv(lp, dcfg, h, cos, sin)
            attn = masked_attention(q, k, v, AttendTo(mask=block_mask_btt, k_cache=ctx_k_lbhsd[i],
                                                      v_cache=ctx_v_lbhsd[i], cache_len=ctx_len_bt,
                                                      cache_start=ctx_start_bt))
            return linear(attn.reshape(b, t, -1), lp["o_proj"]["kernel"], cd)

        def mlp(h):
            gate, up = linear(h, lp["gate_proj"]["kernel"], cd), linear(h, lp["up_proj"]["kernel"], cd)
            return linear(jax.nn.silu(gate) * up, lp["down_proj"]["kernel"], cd)

        x = x + around(lp, CONV_NAMES[0], rms_norm(x, lp["attn_norm"]["scale"], dcfg.rms_eps), attention)
        x = x + around(lp, CONV_NAMES[1], rms_norm(x, lp["mlp_norm"]["scale"], dcfg.rms_eps), mlp)
    return rms_norm(x, p["norm"]["scale"], dcfg.rms_eps)


def block_logits(target_cfg: LlamaConfig, target_params, hidden_btd: jax.Array) -> jax.Array:
    """Float32 logits of the target's (frozen) LM head."""
    return target_logits(jax.lax.stop_gradient(target_params), target_cfg, hidden_btd)


def sequence_context(p: dict, dcfg: LlamaConfig, taps_bsc: jax.Array, positions_bs: Optional[jax.Array] = None):
    """The context K/V of a whole row (training, tests): (k, v) [L,B,Hkv,S,hd] of c at every position."""
    b, s = taps_bsc.shape[:2]
    if positions_bs is None:
        positions_bs = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    k, v = context_kv(p, dcfg, context_features(p, dcfg, taps_bsc), positions_bs)
    return jnp.swapaxes(k, 2, 3), jnp.swapaxes(v, 2, 3)


def block_self_mask(b: int, block_size: int, causal: bool = False) -> jax.Array:
    """[B, bs, bs]: which block positions a block position sees — all of them (DFlash: bidirectional) or,
    for a causal head (JetSpec's ``causal_head``), itself and those before it (the reference's
    ``_build_dflash_causal_attention_mask``: key j visible iff j <= the query's position; the context is
    before the block, so it stays whole)."""
    m = jnp.tril(jnp.ones((block_size, block_size), bool)) if causal else jnp.ones((block_size, block_size), bool)
    return jnp.broadcast_to(m, (b, block_size, block_size))


def draft_blocks(p: dict, dcfg: LlamaConfig, target_cfg: LlamaConfig, target_params, taps_bsc, tokens_bs,
                 anchors_bn: jax.Array, mask_token_id: int, block_size: int, positions_bs=None, segment_start_bs=None,
                 causal: bool = False):
    """N blocks per row, block i = [x[a_i], M, ..., M] at positions a_i..a_i+bs-1 (``positions_bs`` of the
    anchor + offset), each seeing the context strictly before its anchor (within the anchor's
    conversation, ``segment_start_bs``) and itself bidirectionally (SpecForge's
    ``create_dflash_block_mask``), or with ``causal`` (JetSpec's causal head) its positions up to each
    query's own (:func:`block_self_mask`) -> final-normed hidden [B,N,bs,d]."""
    b, n = anchors_bn.shape
    k_ctx, v_ctx = sequence_context(p, dcfg, taps_bsc, positions_bs)
    rows = jnp.arange(b)[:, None]
    first = tokens_bs[rows, anchors_bn]  # [B,N]
    blk = jnp.full((b, n, block_size), mask_token_id, jnp.int32).at[:, :, 0].set(first)
    pos0 = anchors_bn if positions_bs is None else positions_bs[rows, anchors_bn]
    pos = (pos0[..., None] + jnp.arange(block_size, dtype=jnp.int32)).reshape(b, n * block_size)
    blk_id = jnp.arange(n * block_size) // block_size
    same = blk_id[:, None] == blk_id[None, :]
    if causal:
        same = same & (jnp.arange(n * block_size)[:, None] >= jnp.arange(n * block_size)[None, :])
    mask = jnp.broadcast_to(same, (b, n * block_size, n * block_size))
    ctx_len = jnp.repeat(anchors_bn, block_size, axis=1)
    ctx_start = None if segment_start_bs is None else jnp.repeat(segment_start_bs[rows, anchors_bn], block_size, axis=1)
    h = block_hidden(p, dcfg, embed_block(target_params, blk.reshape(b, -1)), pos, mask, k_ctx, v_ctx, ctx_len,
                     ctx_start, block_len=block_size)
    return h.reshape(b, n, block_size, -1)


# ----------------------------------------------------------------------------- the published layout

_TOP = {"fc/kernel": "fc.weight", "hidden_norm/scale": "hidden_norm.weight", "norm/scale": "norm.weight"}
_LAYER = {"attn_norm/scale": "input_layernorm.weight", "q_proj/kernel": "self_attn.q_proj.weight",
          "k_proj/kernel": "self_attn.k_proj.weight", "v_proj/kernel": "self_attn.v_proj.weight",
          "q_norm/scale": "self_attn.q_norm.weight", "k_norm/scale": "self_attn.k_norm.weight",
          "o_proj/kernel": "self_attn.o_proj.weight", "mlp_norm/scale": "post_attention_layernorm.weight",
          "gate_proj/kernel": "mlp.gate_proj.weight", "up_proj/kernel": "mlp.up_proj.weight",
          "down_proj/kernel": "mlp.down_proj.weight"}
_CONV = {f"{side}/{leaf}": f"{side}.{name}" for side in CONV_NAMES
         for leaf, name in (("base_kernel", "base_kernel"), ("kernel_projection", "kernel_projection.weight"))}


def to_reference_state_dict(params: dict) -> dict:
    """numpy state dict in the reference's ``DFlashDraftModel`` names (``fc``, ``hidden_norm``, ``norm``,
    ``layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
    post_attention_layernorm, mlp.{gate,up,down}_proj}.weight``; ``Linear.weight`` [out, in]); a DFlash2
    tree adds ``layers.{i}.{attention,mlp}_conv.{base_kernel, kernel_projection.weight}`` (speculators')."""
    leaves = _leaves(model_params(params))
    out = {}
    for path, name in _TOP.items():
        x = np.asarray(leaves[path])
        out[name] = np.ascontiguousarray(x.T if path.endswith("kernel") else x)
    n_layers = np.shape(leaves["layers/q_proj/kernel"])[0]
    layer = {**_LAYER, **{k: v for k, v in _CONV.items() if f"layers/{k}" in leaves}}
    for path, name in layer.items():
        x = np.asarray(leaves[f"layers/{path}"])
        for i in range(n_layers):
            out[f"layers.{i}.{name}"] = np.ascontiguousarray(x[i].T if _transposed(path) else x[i])
    return out


def _transposed(path: str) -> bool:
    """Leaves stored as torch ``Linear.weight`` ([out, in]; ours [in, out])."""
    return path.endswith("/kernel") or path.endswith("kernel_projection")


def from_reference_state_dict(sd: dict, dcfg: LlamaConfig, n_taps: int, dtype=np.float32, conv=None) -> dict:
    """Our tree from a reference state dict (an optional ``model.`` prefix is dropped; ``rotary_emb``
    buffers ignored). Every key is required with the shape ``dcfg`` / ``n_taps`` (/ DFlash2's ``conv``) give."""
    sd = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in sd.items()
          if not k.endswith("rotary_emb.inv_freq")}
    layer_names = {**_LAYER, **(_CONV if conv is not None else {})}
    want = dict(_TOP)
    for path, name in layer_names.items():
        for i in range(dcfg.n_layers):
            want[f"layers/{path}@{i}"] = f"layers.{i}.{name}"
    missing = sorted(set(want.values()) - set(sd))
    extra = sorted(set(sd) - set(want.values()))
    if missing or extra:
        raise ValueError(f"DFlash state dict: missing keys {missing[:6]}{'...' if len(missing) > 6 else ''}, "
                         f"unexpected keys {extra[:6]}{'...' if len(extra) > 6 else ''}")
    shapes = param_shapes(dcfg, n_taps, conv)
    flat = {}
    for path, shape in shapes.items():
        is_kernel = _transposed(path)
        if path.startswith("layers/"):
            sub = path[len("layers/"):]
            xs = [np.asarray(sd[f"layers.{i}.{layer_names[sub]}"], dtype) for i in range(dcfg.n_layers)]
            x = np.stack([a.T if is_kernel else a for a in xs])
            name = f"layers.*.{layer_names[sub]}"
        else:
            a = np.asarray(sd[_TOP[path]], dtype)
            x, name = (a.T if is_kernel else a), _TOP[path]
        if x.shape != shape:
            raise ValueError(f"DFlash tensor {name}: expected shape {shape} (ours; torch's is transposed for "
                             f"kernels), got {x.shape}")
        flat[path] = np.ascontiguousarray(x)
    return _tree(flat)
