"""Architectures of the targets this project ships configs for.

SmolLM2-135M runs here (CPU); Llama-3.2-3B and Llama-3.1-8B are the paper's targets and are
exercised on CPU by shape-only tracing. Real checkpoints overwrite these when loaded
(``confu_jax.weights``), so a preset is a description, not a source of truth for weights.
"""

from confu_jax.models.llama import LlamaConfig

PRESETS = {
    # Random weights; for unit tests. 8 layers so the EAGLE-3 taps (2, 4, 5) are distinct.
    "tiny": LlamaConfig(vocab_size=128, d_model=64, n_layers=8, n_heads=4, n_kv_heads=2,
                        head_dim=16, ffn_dim=128, rope_theta=10000.0, tie_embeddings=True,
                        max_position_embeddings=1024, eos_token_ids=(1,)),
    # A tiny random Llama with a byte-level BPE chat tokenizer, written as a GGUF by the tests
    # (tests/helpers/tiny_chat_model.py: tiny_chat_gguf(..., layers=8, max_pos=2048)): the GPU
    # campaign's CPU dry run trains and benchmarks heads on it through the SmolLM2 code path
    # (experiments.gpu_campaign); 2048 positions hold MT-Bench prompts at ~a token per byte.
    "tiny-chat": LlamaConfig(vocab_size=300, d_model=64, n_layers=8, n_heads=4, n_kv_heads=2,
                             head_dim=16, ffn_dim=96, rope_theta=10000.0, rms_eps=1e-5, tie_embeddings=False,
                             max_position_embeddings=2048, bos_token_id=1, eos_token_ids=(2,)),
    "smollm2-135m": LlamaConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9,
                                n_kv_heads=3, head_dim=64, ffn_dim=1536, rope_theta=100000.0,
                                rms_eps=1e-5, tie_embeddings=True, max_position_embeddings=8192,
                                bos_token_id=1, eos_token_ids=(2,)),
    "llama-3.2-3b": LlamaConfig(vocab_size=128256, d_model=3072, n_layers=28, n_heads=24,
                                n_kv_heads=8, head_dim=128, ffn_dim=8192, rope_theta=500000.0,
                                rope_scaling=(32.0, 1.0, 4.0, 8192), rms_eps=1e-5,
                                tie_embeddings=True, max_position_embeddings=131072,
                                dtype="bfloat16", param_dtype="bfloat16",
                                bos_token_id=128000, eos_token_ids=(128001, 128008, 128009)),
    "llama-3.1-8b": LlamaConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                                n_kv_heads=8, head_dim=128, ffn_dim=14336, rope_theta=500000.0,
                                rope_scaling=(8.0, 1.0, 4.0, 8192), rms_eps=1e-5,
                                tie_embeddings=False, max_position_embeddings=131072,
                                dtype="bfloat16", param_dtype="bfloat16",
                                bos_token_id=128000, eos_token_ids=(128001, 128008, 128009)),
    # Qwen3-8B (config.json of Qwen/Qwen3-8B): the second 8B shape of the scale table
    # (launch.train --compile_only --config.model.source=abstract); a real checkpoint brings its own.
    "qwen3-8b": LlamaConfig(vocab_size=151936, d_model=4096, n_layers=36, n_heads=32, n_kv_heads=8,
                            head_dim=128, ffn_dim=12288, rope_theta=1000000.0, rms_eps=1e-6,
                            tie_embeddings=False, max_position_embeddings=40960, dtype="bfloat16",
                            param_dtype="bfloat16", eos_token_ids=(151645, 151643), qk_norm=True),
}


def get_preset(name: str) -> LlamaConfig:
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}")
    return PRESETS[name]
