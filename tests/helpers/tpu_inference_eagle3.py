"""tpu-inference's own JAX EAGLE-3 on an exported head: run in tpu-inference's environment
(``launch/tpu_inference_venv.sh``), never in ours; it imports nothing of confu_jax.

    .venv-tpu-inference/bin/python tests/helpers/tpu_inference_eagle3.py \
        --target TARGET_HF_DIR --draft EXPORT_DIR --inputs in.npz --out out.npz

What runs is tpu-inference 0.32.0's code path for a draft head, as its own test
(``tests/models/jax/test_llama_eagle3.py``) builds it: ``EagleLlama3ForCausalLM`` from the vLLM
config, ``load_weights`` (its ``EagleLlama3WeightLoader`` over the export's safetensors: its name map,
reshapes, transposes, head-dim padding), the target's embedding shared in as its Eagle3 proposer does,
``combine_hidden_states`` (fc over the three taps), the draft layer with its KV cache, and
``compute_logits`` (the draft vocabulary scattered to the target's by ``draft_id_to_target_id``).

One patch, because its attention is a TPU Pallas kernel (Mosaic TPU does not run on a CPU):
``sharded_ragged_paged_attention`` is replaced by the same package's pure-JAX reference
``ref_ragged_paged_attention`` (``kernels/ragged_paged_attention/v3/kernel.py``; the head_dim-64
variant for 64-wide heads), one device, the same paged KV cache layout and masks.

Writes ``logits`` [T, V_target] (float32, -inf outside the draft vocabulary), the loaded parameters
(``p/<path>``) and ``d2t_offsets``.
"""

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")


def _patch_attention():
    """The TPU kernel -> tpu-inference's own reference (see the module docstring)."""
    import tpu_inference.kernels.ragged_paged_attention.v3.kernel as rpa
    import tpu_inference.kernels.ragged_paged_attention.v3.kernel_hd64 as rpa64
    import tpu_inference.layers.common.attention_interface as ai

    def ref(mesh, q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, attention_sink, sm_scale,
            attention_chunk_size=None, q_scale=None, k_scale=None, v_scale=None, update_kv_cache=True,
            use_causal_mask=True, attn_logits_soft_cap=None, decode_query_size=1):
        assert attention_sink is None and update_kv_cache, "not used by the EAGLE-3 draft"
        kw = dict(sm_scale=sm_scale, sliding_window=attention_chunk_size, soft_cap=attn_logits_soft_cap,
                  q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
        if q.shape[-1] == 64:
            return rpa64.ref_ragged_paged_attention_hd64(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens,
                                                         distribution, **kw)
        return rpa.ref_ragged_paged_attention(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
                                              use_causal_mask=use_causal_mask, **kw)

    ai.sharded_ragged_paged_attention = ref


class _Speculative:
    def __init__(self, draft_model_config):
        self.num_speculative_tokens = 3
        self.method = "eagle3"
        self.draft_model_config = draft_model_config


class _VllmConfig:
    """The vLLM config tpu-inference's own EAGLE-3 test builds (MockVllmConfig there)."""

    def __init__(self, target: str, draft: str):
        from unittest.mock import MagicMock

        import jax.numpy as jnp
        from vllm.config import LoadConfig, ModelConfig

        self.model_config = ModelConfig(target, skip_tokenizer_init=True)
        self.model_config.dtype = jnp.bfloat16
        self.load_config = LoadConfig()
        self.additional_config = {}
        self.speculative_config = _Speculative(ModelConfig(draft, dtype="bfloat16", max_model_len=2048,
                                                           skip_tokenizer_init=True))
        self.cache_config = MagicMock(cache_dtype="auto")


def main():
    ap = argparse.ArgumentParser()
    for name in ("target", "draft", "inputs", "out"):
        ap.add_argument(f"--{name}", required=True)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh

    _patch_attention()
    from tpu_inference.layers.common.attention_metadata import AttentionMetadata
    from tpu_inference.models.common.model_loader import _get_model_architecture, _get_nnx_model
    from tpu_inference.runner.kv_cache import create_kv_caches

    cfg = _VllmConfig(args.target, args.draft)
    hf = cfg.speculative_config.draft_model_config.hf_config
    model_class = _get_model_architecture(hf)  # its registry: the architecture string must reach the JAX model
    inp = np.load(args.inputs)
    ids, h_cat, embed = inp["ids"], inp["h_cat"], inp["embed"]
    t = len(ids)
    mesh = Mesh(np.array(jax.local_devices()[:1]).reshape((1, 1, -1)), axis_names=("data", "attn_dp", "model"))
    with jax.set_mesh(mesh):
        # its loader's path for a draft: an abstract model, load_weights, then the jitted model
        model = _get_nnx_model(model_class, cfg, jax.random.PRNGKey(0), mesh, is_draft_model=True)
        # the proposer shares the target's embedding into a draft that has none (spec_decode/jax/eagle3.py)
        assert not jnp.any(model.model.embed_tokens.embedding[...]), "the export carries no embedding"
        model.model.embed_tokens.embedding[...] = jnp.asarray(embed, jnp.bfloat16)
        block = 16
        pages = -(-t // block)
        kv_caches = create_kv_caches(num_blocks=pages, block_size=block, num_kv_heads=hf.num_key_value_heads,
                                     head_size=hf.head_dim, mesh=mesh, layer_names=["draft"], cache_dtype=jnp.bfloat16)
        md = AttentionMetadata(input_positions=jnp.arange(t, dtype=jnp.int32),
                               block_tables=jnp.arange(pages, dtype=jnp.int32),
                               seq_lens=jnp.array([t], jnp.int32), query_start_loc=jnp.array([0, t], jnp.int32),
                               request_distribution=jnp.array([0, 0, 1], jnp.int32))
        hidden = model.combine_hidden_states(jnp.asarray(h_cat, jnp.bfloat16))
        _, out_hidden, _, _ = model(kv_caches, jnp.asarray(ids, jnp.int32), hidden, md)
        logits = model.compute_logits(out_hidden)
    params = {"p/" + "/".join(str(k) for k in path): np.asarray(v.get_value(), np.float32)
              for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    np.savez(args.out, logits=np.asarray(logits, np.float32), d2t_offsets=np.asarray(
        model.draft_id_to_target_id[...]), model_class=model_class.__name__, **params)


if __name__ == "__main__":
    main()
