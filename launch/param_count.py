"""Print parameter counts of a config's target, draft head and ConFu extras (shapes only).

    python -m launch.param_count --config configs/llama31_8b_confu.py
    python -m launch.param_count --config configs/tiny.py:eagle3

Uses ``jax.eval_shape``: nothing is allocated, so the 8B config runs on a laptop.
"""

from __future__ import annotations

from absl import app
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/<name>.py[:param]", lock_config=True)


def format_counts(name: str, counts: dict) -> str:
    target = counts["target"]
    lines = [f"{name}"]
    for key in ("target", "draft", "confu_extras", "confu_soft_prompts", "confu_moe_con", "confu_moe_f",
                "trainable"):
        share = f"  ({100.0 * counts[key] / target:6.2f}% of target)" if key != "target" else ""
        indent = "    " if key.startswith("confu_") and key != "confu_extras" else "  "
        lines.append(f"{indent}{key:<20}{counts[key]:>15,}{share}")
    return "\n".join(lines)


def main(argv):
    del argv
    from confu_jax.models.params import param_counts
    from confu_jax.models.spec import model_spec_from_config

    config = _CONFIG.value
    if config is None:
        raise app.UsageError("--config is required, e.g. --config configs/smollm2_confu.py")
    if config.model.source not in ("", "random"):
        from confu_jax.train.target_loading import resolve_target

        resolve_target(config)  # the checkpoint's architecture (its config.json / GGUF header only)
    spec = model_spec_from_config(config)
    title = f"{config.model.preset or config.model.source} / {config.confu.variant}"
    print(format_counts(title, param_counts(spec)))


if __name__ == "__main__":
    from confu_jax.user_errors import run

    run("launch.param_count", main)
