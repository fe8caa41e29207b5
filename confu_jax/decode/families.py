"""The registry of drafter families: the list of the modules that declare them.

Each family's own module declares its records (``FAMILIES``: a ``decode.family.DrafterFamily`` each,
with the methods it decodes, its plan reader, its loader, budget candidates and export formats;
``confu_jax.catalog`` adds each one's training task and configs); everything the CLIs, the benchmark and budget ``auto`` ask about a family
or a method by name is read from here, so no other module switches on a family's name.

Adding a family: its own modules (drafter + record, model, training task, run loader, published
format), then its drafter module in ``_MODULES`` and, if it trains, its entry in ``confu_jax.catalog``
(docs/families.md "Adding a family");
``tests/contract/test_families.py`` checks every record's contract.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from confu_jax.decode import (dflash, dflash2, domino, draft_model, drafting, dspark, hybrid, jetspec, lookup, medusa,
                              mlp_speculator, mtp, peagle)
from confu_jax.decode.drafter import Drafter
from confu_jax.decode import loaded as heads
from confu_jax.decode.family import DrafterFamily, Method

_MODULES = (drafting, lookup, hybrid, draft_model, medusa, mlp_speculator, mtp, dflash, peagle, dspark, jetspec,
            dflash2, domino)

FAMILIES: dict = {f.name: f for module in _MODULES for f in module.FAMILIES}

# the two methods that are not a drafter family: the baseline, and the benchmark's choice among the others
_AR = Method("ar", (), "autoregressive decoding: one target pass per token (the baseline)", "ar")
_AUTO = Method("auto", (), "benchmark only: budget auto across the run's other methods (family and plan)", "auto")

METHODS: dict = {m.name: m for m in (
    _AR, *(dataclasses.replace(m, family=f.name) for f in FAMILIES.values() for m in f.methods), _AUTO)}

_names = [m.name for f in FAMILIES.values() for m in f.methods]
if len(set(_names)) != len(_names) or {"ar", "auto"} & set(_names):
    raise ValueError(f"drafter families declare a method name twice (or 'ar' / 'auto'): {sorted(_names)}")

SPECULATIVE_METHODS = tuple(name for name, m in METHODS.items() if m.speculative)


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"unknown decoding method {name!r}; expected one of {tuple(METHODS)}")
    return METHODS[name]


def family_of(method: str) -> DrafterFamily:
    """The record of the family ``method`` drafts with (errors name the methods that draft)."""
    fam = get_method(method).family
    if fam not in FAMILIES:
        drafting_methods = sorted(name for name, m in METHODS.items() if m.family in FAMILIES)
        raise ValueError(f"method {method!r} does not draft (family {fam!r}); the drafting methods: "
                         f"{drafting_methods}")
    return FAMILIES[fam]


def parse_drafter(method: str, text: str) -> Drafter:
    """The drafter ``method`` decodes with under the plan ``text`` (errors list the accepted forms)."""
    return family_of(method).parse(text)


def _depth_limit(fam: DrafterFamily, head: heads.LoadedDrafter) -> Optional[int]:
    return fam.max_depth(head.drafter_params) if fam.max_depth is not None else None


def check_plan(method: str, drafter: Drafter, head: heads.LoadedDrafter) -> None:
    """Refuse a plan deeper than the loaded weights draft (``DrafterFamily.max_depth``: Medusa's head
    count, a trained DFlash draft's block), naming both, before anything is traced."""
    fam = family_of(method)
    limit = _depth_limit(fam, head)
    if limit is not None and drafter.max_depth > limit:
        raise ValueError(f"plan {drafter.describe()!r} drafts {drafter.max_depth} deep; the {fam.name} weights of "
                         f"{head.source} draft at most {limit} deep (expected a plan of depth <= {limit})")


def fits_head(method: str, text: str, head: heads.LoadedDrafter) -> bool:
    """Whether ``method``'s plan ``text`` is no deeper than ``head``'s weights draft (budget ``auto``
    keeps only the candidates that fit)."""
    fam = family_of(method)
    limit = _depth_limit(fam, head)
    return limit is None or fam.parse(text).max_depth <= limit


def drafter_for(method: str, text: Optional[str], head: heads.LoadedDrafter) -> Drafter:
    """The drafter ``method`` decodes ``head`` with under the plan ``text`` (None: the family's default
    plan for these weights), checked against what the weights draft (``check_plan``)."""
    fam = family_of(method)
    drafter = fam.parse(text or fam.default_plan(head.drafter_params))
    check_plan(method, drafter, head)
    return drafter


# every ``launch.export_head --format`` (``runs.exports.ExportFormat``), family by family
EXPORT_FORMATS: dict = {f.name: f for fam in FAMILIES.values() for f in fam.export_formats}


def export_formats() -> tuple:
    """The names of every ``launch.export_head --format``, family by family."""
    return tuple(EXPORT_FORMATS)


def decode_head(method: str, target_cfg, target_params: dict, workdir: Optional[str] = None, seed: int = 0,
                target_source: str = "the loaded target", target_tokenizer=None) -> heads.LoadedDrafter:
    """What ``method`` drafts with (``DrafterFamily.load``): a trained head from ``workdir`` (a
    ``launch.train`` workdir, ``WORKDIR@STEP`` where the family reads steps, a release or a published
    layout), a random one, nothing (model-free methods, which refuse a source), or a draft model
    (``target_tokenizer`` checks an external model's tokenizer)."""
    fam = family_of(method)
    workdir, step = heads.split_step(workdir)
    if step is not None and not fam.reads_step:
        raise ValueError(f"{workdir}@{step}: a checkpoint step (WORKDIR@STEP) is read for EAGLE-3 / ConFu "
                         f"heads only; method {method!r} (family {fam.name}) loads its run's latest step")
    return fam.load(get_method(method), target_cfg, target_params, workdir, seed=seed, step=step,
                    target_source=target_source, target_tokenizer=target_tokenizer)
