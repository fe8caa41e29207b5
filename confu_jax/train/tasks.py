"""The training tasks by name: what ``config.train.task`` names.

Each shipped family's training task is imported here under its family's name (the name of its
``decode.family.DrafterFamily`` record; ``confu_jax.catalog`` pairs the two and its contract test
checks they agree), so every edge from a config to the code that trains it is an import the layering
test sees. A task outside the package (the suite's toy task, a user's own objective) is named
``"package.module:function"`` instead: the one string form, for code this package cannot import.
"""

from __future__ import annotations

import importlib
from typing import Callable

from confu_jax.train import (confu_task, dflash2_task, dflash_task, domino_task, dspark_task, medusa_task,
                             mlp_speculator_task, mtp_task, peagle_task, sd2_task)
from confu_jax.train.task import TrainTask, resolve_run_config

TASKS: dict = {
    "head": confu_task.build_task,  # EAGLE-3, EAGLE 3.1, ConFu and its ablations (config.confu.variant)
    "peagle": peagle_task.build_task,
    "sd2": sd2_task.build_task,
    "medusa": medusa_task.build_task,
    "mlp_speculator": mlp_speculator_task.build_task,
    "mtp": mtp_task.build_task,
    "dflash": dflash_task.build_task,
    "dspark": dspark_task.build_task,
    "dflash2": dflash2_task.build_task,
    "domino": domino_task.build_task,
    "jetspec": dflash_task.build_task,  # DFlash's task with dflash.causal_head (dflash_task.apply_jetspec_defaults)
}


def resolve(spec: str) -> Callable:
    """The function ``config.train.task`` names: a name in :data:`TASKS`, or ``'package.module:function'``
    for a task outside the package."""
    if spec in TASKS:
        return TASKS[spec]
    if ":" not in spec:
        raise ValueError(f"config.train.task={spec!r}: expected one of {sorted(TASKS)} or "
                         f"'package.module:function' (a task outside the package)")
    mod_name, fn_name = spec.split(":", 1)
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ImportError(f"config.train.task={spec!r}: cannot import module {mod_name!r}: {e}") from e
    fn = getattr(mod, fn_name, None)
    if fn is None:
        raise AttributeError(f"config.train.task={spec!r}: module {mod_name!r} has no {fn_name!r}")
    return fn


def load_task(config) -> TrainTask:
    """Build the task ``config.train.task`` names (:func:`resolve`), after sizing the config from its
    checkpoint (``target_loading.resolve_target``: fills ``config.model.arch``) and its default batch;
    the run's own mesh checks the batch (``loop.setup_run``)."""
    config = resolve_run_config(config, strict=False)
    spec = config.train.task
    task = resolve(spec)(config)
    if not isinstance(task, TrainTask):
        raise TypeError(f"config.train.task={spec!r} returned {type(task).__name__}, expected TrainTask")
    return task
