"""The frozen target a training run trains against, from ``config.model.source``.

``'asset:<name>'``, a GGUF file or a Hugging Face directory (checked against the preset's
parameter shapes), or ``'random'`` (random weights from ``config.synthetic.seed``: tests and smoke
runs). The loaded checkpoint's LlamaConfig replaces the preset's, keeping the config's dtypes.
"""

from __future__ import annotations

import dataclasses

import jax

from confu_jax.models.llama import init_params as llama_init, param_shapes
from confu_jax.models.spec import ModelSpec


def strip_asset(source: str) -> str:
    return source[len("asset:"):] if source.startswith("asset:") else source


def load_target(config, spec: ModelSpec) -> tuple[ModelSpec, dict]:
    """(spec with the checkpoint's LlamaConfig, host params) for ``config.model.source``."""
    source = config.model.source
    if source == "random":
        seed = int(config.synthetic.seed) if "synthetic" in config else 0
        params = jax.device_get(llama_init(spec.target, jax.random.PRNGKey(seed)))
        return spec, params
    if not source:
        raise ValueError(f"config.model.source is empty for preset {config.model.preset!r}: pass "
                         "--config.model.source=/path/to/checkpoint (GGUF file or Hugging Face directory)")
    from confu_jax.weights import load_model

    cfg, params = load_model(strip_asset(source), config.model.param_dtype)
    want = jax.tree_util.tree_map(lambda x: (tuple(x.shape), str(x.dtype)), param_shapes(spec.target))
    got = jax.tree_util.tree_map(lambda x: (tuple(x.shape), str(x.dtype)), params)
    if want != got:
        bad = [(jax.tree_util.keystr(p), w, g) for (p, w), g in
               zip(jax.tree_util.tree_leaves_with_path(want, is_leaf=lambda x: isinstance(x, tuple)),
                   jax.tree_util.tree_leaves(got, is_leaf=lambda x: isinstance(x, tuple))) if w != g][:5]
        raise ValueError(f"{source}: parameters do not match preset {config.model.preset!r} "
                         f"(path, expected, found): {bad or 'different tree structure'}")
    target = cfg.replace(dtype=spec.target.dtype, param_dtype=spec.target.param_dtype,
                         attention_impl=spec.target.attention_impl)
    return dataclasses.replace(spec, target=target), params  # keeps the spec's draft_model (DFlash, SD²)
