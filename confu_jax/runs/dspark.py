"""A trained DSpark run (``launch.train`` with ``configs/*_dspark.py``) as decode loads it.

Why here: decode never imports train (docs/DESIGN.md §2); the run's checkpoint holds only the draft
(``{'draft': {'dspark': ...}}``, ``models.dspark``), whose shapes follow from the target and the run's
``dspark`` section; the mask token and block size are the run's config; its ``target.json`` says which
target it was trained on (the draft reads that target's taps and uses its embedding and LM head).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import numpy as np

from confu_jax.models.dflash import default_taps, draft_config
from confu_jax.models.llama import LlamaConfig


class DSparkRun(NamedTuple):
    params: dict  # numpy models.dspark tree (no decode scalars)
    draft: LlamaConfig
    taps: tuple
    mask_token_id: int
    block_size: int
    step: int
    source: str


def is_dspark_workdir(path: str) -> bool:
    """A ``launch.train`` workdir whose config has a ``dspark`` section."""
    from confu_jax.runs.heads import is_family_workdir

    return is_family_workdir(path, "dspark")


def load_dspark_run(workdir: str, target_cfg: LlamaConfig, target_params, *, step: Optional[int] = None,
                    target_source: str = "the loaded target") -> DSparkRun:
    """The draft of a run (last checkpoint, or ``step``), target checked by fingerprint."""
    from confu_jax.models.dspark import init_dspark
    from confu_jax.runs.heads import load_family_run

    def taps_of(config):
        taps = (config.get("draft") or {}).get("tap_layers")
        return tuple(int(t) for t in taps) if taps is not None else default_taps(target_cfg.n_layers)

    def abstract(config):
        dc = config["dspark"]
        dcfg = draft_config(target_cfg, int(dc["num_layers"]))
        shapes = jax.eval_shape(lambda: init_dspark(
            jax.random.PRNGKey(0), dcfg, len(taps_of(config)), target_cfg.vocab_size, rank=int(dc["markov_rank"]),
            kind=str(dc["markov_head_type"]), confidence=bool(dc["enable_confidence_head"]),
            confidence_with_markov=bool(dc["confidence_head_with_markov"])))
        return {"draft": {"dspark": shapes}}

    params, step, config, workdir = load_family_run(
        workdir, "dspark", abstract, target_params, step=step, target_source=target_source,
        why="a DSpark draft reads its own target's taps, embedding and LM head")
    dc = config["dspark"]
    return DSparkRun(jax.tree_util.tree_map(np.asarray, params["draft"]["dspark"]),
                     draft_config(target_cfg, int(dc["num_layers"])), taps_of(config), int(dc["mask_token_id"]),
                     int(dc["block_size"]), step, f"{workdir} (step {step})")
