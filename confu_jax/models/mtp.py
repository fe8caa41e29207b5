"""The multi-token prediction (MTP) module of DeepSeek-V3 (DeepSeek-AI 2024, "DeepSeek-V3 Technical
Report", arXiv:2412.19437, §2.2), as its serving implementations define it: vLLM
``vllm/model_executor/models/deepseek_mtp.py`` (``DeepSeekMultiTokenPredictorLayer``, ``SharedHead``)
and SGLang ``python/sglang/srt/models/deepseek_nextn.py`` (``DeepseekModelNextN``), for a Llama-family
target: the transformer block is one Llama decoder layer with the target's layer configuration.

Why a separate family: like EAGLE it is one transformer layer with its own KV cache that reads the
target's hidden state and the next token, and drafts recursively on its own output; unlike EAGLE-3 it
reads the target's **final-normed last hidden state** (no multi-layer taps), projects the pair down to
d *before* the layer (a plain Llama layer, not EAGLE-3's 2d-input attention), and shares the target's
embedding and LM head (no draft vocabulary, no head of its own).

One depth (position i; h = the target's final-normed hidden state h[i] at depth 1, the module's own
output h'[i] of the previous depth deeper; x = the next token on the path)::

    u     = eh_proj( [ enorm(Emb(x)) ; hnorm(h) ] )        # [2d] -> [d]; embedding FIRST (vLLM, SGLang)
    h'    = LlamaDecoderLayer(u)                           # pre-norm attention + SwiGLU, residuals;
                                                           # attends the same depth's earlier positions
    logits = LMHead( shared_head.norm(h') )                # the target's LM head (frozen)

``h'`` (the pre-norm output, vLLM's ``residual + hidden_states``) is what the next depth reads. The
report writes the concatenation as [RMSNorm(h); RMSNorm(Emb)]; both references put the embedding first
and the published checkpoints' ``eh_proj`` is laid out so — we follow them. vLLM also zeroes the
embedding at position 0 (``inputs_embeds[positions == 0] = 0``); SGLang and the report do not, and
neither do we (it changes only the one entry at position 0).

Parameters (``DrafterParams.weights['mtp']``; kernels [in, out] as flax, torch ``Linear.weight`` is
[out, in])::

    {'enorm': {'scale': [d]}, 'hnorm': {'scale': [d]},
     'eh_proj': {'kernel': [2d, d]},                     # rows 0..d-1 read enorm(Emb), d..2d-1 hnorm(h)
     'block': {one Llama DecoderLayer: 'attn_norm', 'q_proj', 'k_proj', 'v_proj', 'o_proj',
               'mlp_norm', 'gate_proj', 'up_proj', 'down_proj'; + q/k/v biases on a Qwen2 target,
               'q_norm' / 'k_norm' on a Qwen3 one},   # the target's own layer layout
     'shared_head': {'norm': {'scale': [d]}}}

The embedding and the LM head (``shared_head.head``) are the target's and are never copied here or
trained; ``shared_head.norm`` is the module's own (DeepSeek's checkpoint stores one per MTP layer),
initialised from the target's final norm. All RMS norms use the target's ``rms_eps``.

The forward is pure functions over that tree: ``mtp_sequence`` (a whole causal sequence: training and
the transcription tests) and ``mtp_block`` (the decode loop's incremental form: a block of inputs
attending the module's KV cache, a scratch buffer of tree ancestors and the block itself through
``models.draft_decode.attend_blocks``, the machinery the EAGLE-3 head drafts with). Both call the same
``project`` / ``finish`` halves of the layer, so they agree by construction.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from confu_jax.kernels.attention_reference import AttendTo
from confu_jax.kernels.flash_attention import CausalSegments
from confu_jax.models.attention import masked_attention
from confu_jax.models.draft_decode import DraftBlockOutput, attend_blocks
from confu_jax.models.kv_cache import KVCache
from confu_jax.models.llama import LlamaConfig, apply_rope, linear, rms_norm, rope_cos_sin
from confu_jax.models.unrolled import shared_params, target_logits


# ----------------------------------------------------------------------------- shapes


def block_shapes(cfg: LlamaConfig) -> dict:
    """{name: shape} of one decoder layer of ``cfg`` (the target's layer, ``params['layers']`` sliced)."""
    d, hq, hkv, hd, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    out = {"attn_norm/scale": (d,), "q_proj/kernel": (d, hq * hd), "k_proj/kernel": (d, hkv * hd),
           "v_proj/kernel": (d, hkv * hd), "o_proj/kernel": (hq * hd, d), "mlp_norm/scale": (d,),
           "gate_proj/kernel": (d, f), "up_proj/kernel": (d, f), "down_proj/kernel": (f, d)}
    if cfg.attention_bias:  # a Qwen2 target's layer
        out.update({"q_proj/bias": (hq * hd,), "k_proj/bias": (hkv * hd,), "v_proj/bias": (hkv * hd,)})
    if cfg.qk_norm:  # a Qwen3 target's layer
        out.update({"q_norm/scale": (hd,), "k_norm/scale": (hd,)})
    return out


def param_shapes(cfg: LlamaConfig) -> dict:
    """{'path/to/leaf': shape} of an MTP module on a target of config ``cfg``."""
    d = cfg.d_model
    out = {"enorm/scale": (d,), "hnorm/scale": (d,), "eh_proj/kernel": (2 * d, d), "shared_head/norm/scale": (d,)}
    out.update({f"block/{k}": s for k, s in block_shapes(cfg).items()})
    return out


def _leaves(params: dict) -> dict:
    return {"/".join(str(k.key) for k in path): x for path, x in jax.tree_util.tree_leaves_with_path(params)}


def check_mtp_params(params: dict, cfg: LlamaConfig) -> None:
    """Raise unless ``params`` is exactly an MTP module for a target of config ``cfg``."""
    want = param_shapes(cfg)
    got = {k: tuple(np.shape(v)) for k, v in _leaves(params).items()}
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    bad = {k: (got[k], want[k]) for k in set(want) & set(got) if got[k] != want[k]}
    if missing or extra or bad:
        raise ValueError(f"MTP module params do not fit the target (d={cfg.d_model}, heads {cfg.n_heads}/"
                         f"{cfg.n_kv_heads} x {cfg.head_dim}, ffn {cfg.ffn_dim}): missing {missing}, unexpected "
                         f"{extra}, shape (got, expected) {bad}")


def trainable_shapes(cfg: LlamaConfig, dtype=np.float32) -> dict:
    """ShapeDtypeStructs of an MTP module (what a run's checkpoint holds)."""
    out: dict = {}
    for path, shape in param_shapes(cfg).items():
        node = out
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = jax.ShapeDtypeStruct(shape, dtype)
    return out


def init_mtp(rng: jax.Array, cfg: LlamaConfig, target_params, *, init_block: str = "last_layer",
             init_std: float = 0.02, param_dtype=jnp.float32) -> dict:
    """An untrained module: enorm / hnorm scale 1, ``eh_proj`` ~ N(0, init_std), ``shared_head.norm`` =
    the target's final norm, and the block = the target's last decoder layer (``init_block='last_layer'``,
    a warm start for a frozen target) or a fresh layer (``'random'``: N(0, init_std) kernels, norm
    scales 1, biases 0 — the target's own initialisation, ``models.llama._dense``)."""
    d = cfg.d_model
    k_eh, k_blk = jax.random.split(rng)
    sp = shared_params(target_params)
    if init_block == "last_layer":
        if "layers" not in target_params:
            raise ValueError("init_mtp(init_block='last_layer') needs the stacked target tree (params['layers'])")
        block = jax.tree_util.tree_map(lambda x: jnp.asarray(x[-1], param_dtype), dict(target_params["layers"]))
    elif init_block == "random":
        shapes = block_shapes(cfg)
        keys = iter(jax.random.split(k_blk, len(shapes)))
        block = {}
        for path, shape in shapes.items():
            name, leaf = path.split("/")
            key = next(keys)
            init = {"scale": lambda: jnp.ones(shape, param_dtype), "bias": lambda: jnp.zeros(shape, param_dtype),
                    "kernel": lambda: (init_std * jax.random.normal(key, shape)).astype(param_dtype)}[leaf]
            block.setdefault(name, {})[leaf] = init()
    else:
        raise ValueError(f"init_mtp: init_block must be 'last_layer' or 'random', got {init_block!r}")
    return {"enorm": {"scale": jnp.ones((d,), param_dtype)}, "hnorm": {"scale": jnp.ones((d,), param_dtype)},
            "eh_proj": {"kernel": (init_std * jax.random.normal(k_eh, (2 * d, d))).astype(param_dtype)},
            "block": block,
            "shared_head": {"norm": {"scale": jnp.asarray(sp["final_norm"]["scale"], param_dtype)}}}


# ----------------------------------------------------------------------------- the layer


def embed(target_params, tokens_bt) -> jax.Array:
    """The target's (frozen) token embeddings."""
    return jnp.take(jax.lax.stop_gradient(shared_params(target_params)["embed"]["embedding"]), tokens_bt, axis=0)


def project(mtp: dict, cfg: LlamaConfig, emb_btd, hidden_btd, positions_bt):
    """u = eh_proj([enorm(emb); hnorm(h)]) and the layer's post-RoPE q [B,T,Hq,hd], k / v [B,T,Hkv,hd]
    -> (u, q, k, v)."""
    cd = jnp.dtype(cfg.dtype)
    x = jnp.concatenate([rms_norm(emb_btd.astype(cd), mtp["enorm"]["scale"], cfg.rms_eps),
                         rms_norm(hidden_btd.astype(cd), mtp["hnorm"]["scale"], cfg.rms_eps)], axis=-1)
    u = linear(x, mtp["eh_proj"]["kernel"], cd)
    blk = mtp["block"]
    b, t, _ = u.shape
    h = rms_norm(u, blk["attn_norm"]["scale"], cfg.rms_eps)

    def proj(name, heads):
        y = linear(h, blk[name]["kernel"], cd)
        if cfg.attention_bias:  # Qwen2: q/k/v biases, as the target's DecoderLayer adds them
            y = y + blk[name]["bias"].astype(cd)
        return y.reshape(b, t, heads, cfg.head_dim)

    q, k, v = proj("q_proj", cfg.n_heads), proj("k_proj", cfg.n_kv_heads), proj("v_proj", cfg.n_kv_heads)
    if cfg.qk_norm:  # Qwen3: per-head RMSNorm of q and k before RoPE
        q = rms_norm(q, blk["q_norm"]["scale"], cfg.rms_eps)
        k = rms_norm(k, blk["k_norm"]["scale"], cfg.rms_eps)
    cos, sin = rope_cos_sin(positions_bt.astype(jnp.int32), cfg)
    return u, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def finish(mtp: dict, cfg: LlamaConfig, u_btd, attn_bthd) -> jax.Array:
    """The rest of the layer: h' = x + down(silu(gate(n(x))) * up(n(x))), x = u + o_proj(attn)."""
    cd = jnp.dtype(cfg.dtype)
    blk = mtp["block"]
    b, t = attn_bthd.shape[:2]
    x = u_btd + linear(attn_bthd.reshape(b, t, -1), blk["o_proj"]["kernel"], cd)
    h = rms_norm(x, blk["mlp_norm"]["scale"], cfg.rms_eps)
    gate, up = linear(h, blk["gate_proj"]["kernel"], cd), linear(h, blk["up_proj"]["kernel"], cd)
    return x + linear(jax.nn.silu(gate) * up, blk["down_proj"]["kernel"], cd)


def head_norm(mtp: dict, cfg: LlamaConfig, h_out_btd) -> jax.Array:
    """shared_head.norm: what the (target's) LM head reads."""
    return rms_norm(h_out_btd, mtp["shared_head"]["norm"]["scale"], cfg.rms_eps)


def mtp_logits(mtp: dict, cfg: LlamaConfig, target_params, h_out_btd) -> jax.Array:
    """Float32 logits of the target's LM head on shared_head.norm(h')."""
    return target_logits(jax.lax.stop_gradient(target_params), cfg, head_norm(mtp, cfg, h_out_btd))


def mtp_sequence(mtp: dict, cfg: LlamaConfig, target_params, tokens_bt, hidden_btd, positions_bt=None,
                 segment_ids_bt=None) -> jax.Array:
    """One depth over whole sequences: input i = (token ``tokens[i]``, hidden ``hidden[i]``) at RoPE
    ``positions[i]`` (default i), attending inputs j <= i (of its own conversation where packed rows pass
    ``segment_ids_bt``) -> h' [B,T,d] (pre-norm; ``mtp_logits`` scores it). The mask goes down by its
    structure (``CausalSegments``): flash form, no [T, T] scores kept for the backward pass (at rows of
    4096 on Llama-3.1-8B the dense form held 12 GiB of them a chip)."""
    b, t = tokens_bt.shape
    if positions_bt is None:
        positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    u, q, k, v = project(mtp, cfg, embed(target_params, tokens_bt), hidden_btd, positions_bt)
    return finish(mtp, cfg, u, masked_attention(q, k, v, AttendTo(mask=CausalSegments(segment_ids_bt))))


def mtp_block(mtp: dict, cfg: LlamaConfig, target_params, tokens_bt, hidden_btd, positions_bt, *,
              cache: Optional[KVCache] = None, block_mask_btt=None, scratch_k_bmhd=None, scratch_v_bmhd=None,
              scratch_mask_btm=None, logits_index_b=None) -> DraftBlockOutput:
    """The decode loop's incremental form (``models.draft_decode.draft_block``'s contract, no future
    entry): T inputs attending the one-layer ``cache`` (slots < its length), the scratch buffer under
    ``scratch_mask_btm`` and the block under ``block_mask_btt`` (default causal); never writes anything.
    Returns the logits over the target's vocabulary (only at row ``logits_index_b`` when given), the
    shared-head-normed state, h' (the next depth's hidden input) and the block's K/V."""
    b, t = tokens_bt.shape
    u, q, k, v = project(mtp, cfg, embed(target_params, tokens_bt), hidden_btd, positions_bt)
    if block_mask_btt is None:
        block_mask_btt = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    attn = attend_blocks(q, k, v, block_mask_btt, cache, scratch_k_bmhd, scratch_v_bmhd, scratch_mask_btm)
    h_out = finish(mtp, cfg, u, attn)
    hidden = head_norm(mtp, cfg, h_out)
    at = hidden if logits_index_b is None else hidden[jnp.arange(b), logits_index_b][:, None]
    logits = target_logits(target_params, cfg, at)
    return DraftBlockOutput(logits, hidden, h_out, k, v)


# ----------------------------------------------------------------------------- the published layout

# DeepSeek-V3's MTP layer names (model.layers.{N}.*, N = the target's layer count) for a Llama block
_TOP = {"enorm/scale": "enorm.weight", "hnorm/scale": "hnorm.weight", "eh_proj/kernel": "eh_proj.weight",
        "shared_head/norm/scale": "shared_head.norm.weight"}
_BLOCK = {"attn_norm/scale": "input_layernorm.weight", "q_proj/kernel": "self_attn.q_proj.weight",
          "k_proj/kernel": "self_attn.k_proj.weight", "v_proj/kernel": "self_attn.v_proj.weight",
          "o_proj/kernel": "self_attn.o_proj.weight", "mlp_norm/scale": "post_attention_layernorm.weight",
          "gate_proj/kernel": "mlp.gate_proj.weight", "up_proj/kernel": "mlp.up_proj.weight",
          "down_proj/kernel": "mlp.down_proj.weight",
          # a Qwen2 / Qwen3 target's layer (present only where param_shapes has them)
          "q_proj/bias": "self_attn.q_proj.bias", "k_proj/bias": "self_attn.k_proj.bias",
          "v_proj/bias": "self_attn.v_proj.bias", "q_norm/scale": "self_attn.q_norm.weight",
          "k_norm/scale": "self_attn.k_norm.weight"}
SHARED_NAMES = ("embed_tokens.weight", "shared_head.head.weight")  # the target's: checked, never loaded


def reference_names(cfg: Optional[LlamaConfig] = None) -> dict:
    """{our leaf path: the layer-relative reference name} (prefix ``model.layers.{N}.``); with ``cfg``,
    only the tensors a module for that target has."""
    names = {**_TOP, **{f"block/{k}": v for k, v in _BLOCK.items()}}
    if cfg is None:
        return names
    shapes = param_shapes(cfg)
    return {k: v for k, v in names.items() if k in shapes}


def to_reference_state_dict(mtp: dict, layer_index: int) -> dict:
    """numpy state dict in DeepSeek-V3's MTP layout: ``model.layers.{layer_index}.<name>`` for every
    module weight (``Linear.weight`` [out, in]); the shared embedding / LM head are not included."""
    leaves = _leaves(mtp)
    out = {}
    for path, name in reference_names().items():
        if path not in leaves:  # a tensor only Qwen targets' modules have
            continue
        x = np.asarray(leaves[path])
        out[f"model.layers.{layer_index}.{name}"] = np.ascontiguousarray(x.T if path.endswith("kernel") else x)
    return out


def from_reference_state_dict(sd: dict, cfg: LlamaConfig, layer_index: Optional[int] = None, dtype=np.float32):
    """Our tree from a DeepSeek-V3-layout MTP state dict -> (params, layer index, shared) where
    ``shared`` holds the ``embed_tokens`` / ``shared_head.head`` copies the file carries (the target's,
    for the caller to compare). ``layer_index`` None: the one ``model.layers.{N}.eh_proj.weight`` in the
    file. Every module key is required with its shape (``cfg``: the target's); keys of other layers
    are ignored (a full DeepSeek checkpoint holds the main model beside the MTP layer)."""
    if layer_index is None:
        found = sorted({int(k.split(".")[2]) for k in sd if k.startswith("model.layers.") and k.endswith(".eh_proj.weight")})
        if len(found) != 1:
            raise ValueError(f"MTP state dict: expected one model.layers.N.eh_proj.weight, found layers {found}")
        layer_index = found[0]
    prefix = f"model.layers.{layer_index}."
    mine = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    names = reference_names(cfg)
    expected = set(names.values()) | set(SHARED_NAMES)
    missing = sorted(set(names.values()) - set(mine))
    extra = sorted(k for k in mine if k not in expected and not k.endswith("rotary_emb.inv_freq"))
    if missing or extra:
        raise ValueError(f"MTP state dict (layer {layer_index}): missing keys {missing[:6]}"
                         f"{'...' if len(missing) > 6 else ''}, unexpected keys {extra[:6]}"
                         f"{'...' if len(extra) > 6 else ''}")
    shapes = param_shapes(cfg)
    out: dict = {}
    for path, name in names.items():
        x = np.asarray(mine[name], dtype)
        want = shapes[path][::-1] if path.endswith("kernel") else shapes[path]
        if x.shape != want:
            raise ValueError(f"MTP tensor {prefix}{name}: expected shape {want} for the target (d={cfg.d_model}, "
                             f"ffn {cfg.ffn_dim}), got {x.shape}")
        node = out
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = np.ascontiguousarray(x.T) if path.endswith("kernel") else x
    shared = {n: np.asarray(mine[n]) for n in SHARED_NAMES if n in mine}
    return out, layer_index, shared
