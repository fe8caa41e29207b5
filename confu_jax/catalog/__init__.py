"""The family catalog: each drafter family's decoding record beside how it trains.

``decode`` never reaches into ``train`` (docs/DESIGN.md §2), so the two halves of a family meet here,
above both: an :class:`Entry` holds the family's ``decode.family.DrafterFamily`` record (its drafter,
plan reader, loader, methods, export formats) and, where it trains, the function that builds its
``train.task.TrainTask``, its shipped configs and its tiny config — every edge an import the layering
test sees (``tests/contract/test_layers.py``), none a module path in a string. ``config.train.task``
names the task by the family's name (``train.tasks.TASKS``); ``tests/contract/test_families.py``
checks every shipped config resolves to its entry's ``build_task``.

Adding a family: its record in ``decode.families`` and, if it trains, its task in ``train.tasks`` and
its entry here (docs/families.md "Adding a family"). Import time refuses a record without an entry.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from confu_jax.decode import families as decode_families
from confu_jax.decode.family import DrafterFamily
from confu_jax.train import (confu_task, dflash2_task, dflash_task, domino_task, dspark_task, medusa_task,
                             mlp_speculator_task, mtp_task, peagle_task, sd2_task)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One family. ``drafter``: its decoding record; ``build_task(config) -> TrainTask`` (None: it does
    not train here); ``configs``: the shipped configs (``launch.train --config``); ``tiny_config``: the
    one that trains on a random tiny target in seconds (``path.py`` or ``path.py:parameter``: the
    contract tests' kill-and-resume and export round trip); ``packs_rows``: its training runs on packed
    rows where a caller packs (the others read padded rows)."""

    drafter: DrafterFamily
    build_task: Optional[Callable] = None
    configs: tuple = ()
    tiny_config: Optional[str] = None
    packs_rows: bool = False

    @property
    def name(self) -> str:
        return self.drafter.name

    @property
    def trains(self) -> bool:
        return self.build_task is not None


_R = decode_families.FAMILIES
_ENTRIES = (
    Entry(_R["head"], confu_task.build_task, ("configs/smollm2_eagle3.py", "configs/smollm2_confu.py"),
          "configs/tiny.py:eagle3", packs_rows=True),
    Entry(_R["lookup"]),
    Entry(_R["hybrid"]),
    Entry(_R["draft_model"]),
    Entry(_R["sd2"], sd2_task.build_task, ("configs/smollm2_sd2.py",), "configs/tiny_sd2.py"),
    Entry(_R["medusa"], medusa_task.build_task, ("configs/smollm2_medusa.py",), "configs/tiny_medusa.py"),
    Entry(_R["mlp_speculator"], mlp_speculator_task.build_task, ("configs/smollm2_mlp_speculator.py",),
          "configs/tiny_mlp_speculator.py"),
    Entry(_R["mtp"], mtp_task.build_task, ("configs/smollm2_mtp.py",), "configs/tiny_mtp.py", packs_rows=True),
    Entry(_R["dflash"], dflash_task.build_task, ("configs/smollm2_dflash.py",), "configs/tiny_dflash.py"),
    Entry(_R["peagle"], peagle_task.build_task, ("configs/smollm2_peagle.py",), "configs/tiny_peagle.py"),
    Entry(_R["dspark"], dspark_task.build_task, ("configs/smollm2_dspark.py",), "configs/tiny_dspark.py"),
    Entry(_R["jetspec"], dflash_task.build_task, ("configs/smollm2_jetspec.py",), "configs/tiny_jetspec.py"),
    Entry(_R["dflash2"], dflash2_task.build_task, ("configs/smollm2_dflash2.py",), "configs/tiny_dflash2.py"),
    Entry(_R["domino"], domino_task.build_task, ("configs/smollm2_domino.py",), "configs/tiny_domino.py"),
)

CATALOG: dict = {e.name: e for e in _ENTRIES}

if set(CATALOG) != set(_R) or len(CATALOG) != len(_ENTRIES):
    raise ValueError(f"confu_jax.catalog: expected one entry per decode family {sorted(_R)}, "
                     f"got {[e.name for e in _ENTRIES]}")


def entry(name: str) -> Entry:
    """The catalog entry of family ``name`` (errors name the families)."""
    if name not in CATALOG:
        raise ValueError(f"unknown drafter family {name!r}; expected one of {sorted(CATALOG)}")
    return CATALOG[name]


def entry_of(method: str) -> Entry:
    """The entry of the family ``method`` drafts with (``eagle3`` / ``confu``: the heads')."""
    return CATALOG[decode_families.family_of(method).name]


def training() -> tuple:
    """The entries of the families that train here, in catalog order."""
    return tuple(e for e in _ENTRIES if e.trains)
