"""What a drafter family is: its record (``DrafterFamily``), the methods it decodes (``Method``: what
``--method`` names), the budget candidates it offers by default, and the one source resolver every
family's loader reads its weights through.

Each family's own module declares its records (``FAMILIES = (DrafterFamily(...),)``: the drafter, its
plan reader, its loader, its export formats, its methods); the registry (``decode.families``) is the
list of those modules, and ``confu_jax.catalog`` pairs each record with its training. Nothing else switches on a family's name.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Optional, Sequence

# budget auto's default candidates (chains, then trees; bench.budget)
DEFAULT_CHAINS = tuple(f"chain:{k}" for k in range(1, 8))
# EAGLE-2-style dynamic trees with T-1 = 4, 8, 16, 30, 60 non-root nodes
DEFAULT_TREES = ("dynamic:3,2,4", "dynamic:4,4,8", "dynamic:5,6,16", "dynamic:6,8,30", "dynamic:6,10,60")
# per-depth top-k (Medusa's heads, the MLP speculator's stages, DFlash's block positions): Cartesian
# trees, depth <= 3 (the shipped tiny configs have 3 heads / stages)
DEFAULT_CARTESIAN_TREES = ("tree:2,2", "tree:3,2,1", "tree:4,3,2", "dynamic:3,2,4")
DEFAULT_DEPTH = 4  # the default plan drafts chain:4, or as deep as the family's weights allow


@dataclasses.dataclass(frozen=True)
class Method:
    """What a user decodes with (``--method`` / ``--methods``). ``variants``: the EAGLE-3 / ConFu head
    variants it accepts (``models.registry.VARIANTS``; the first for random heads; () = no such head);
    ``own_weights``: it drafts with weights of its family's own kind (Medusa, MTP, ...); ``family``:
    the record it belongs to (filled in by the registry from the record that lists it)."""

    name: str
    variants: tuple
    description: str
    family: str = ""
    own_weights: bool = False

    @property
    def speculative(self) -> bool:
        return self.family != "ar"

    @property
    def chooses_method(self) -> bool:
        """Benchmark-only ``auto``: budget auto picks the family and plan among the run's other methods."""
        return self.family == "auto"

    @property
    def needs_head(self) -> bool:
        """Whether it drafts with trained (or untrained) weights: a workdir / published layout to load."""
        return bool(self.variants) or self.own_weights


@dataclasses.dataclass(frozen=True)
class DrafterFamily:
    """One drafter family. ``parse(text) -> Drafter`` (errors list the forms it accepts);
    ``load(method: Method, target_cfg, target_params, source, *, seed, step, target_source,
    target_tokenizer) -> decode.loaded.LoadedDrafter`` (a trained source, or an initialisation when
    ``source`` is None); ``max_depth(drafter_params)`` -> the deepest plan the loaded weights draft (None: any);
    ``reads_step``: a source may name one checkpoint step (``WORKDIR@STEP``); ``source_flag``: the
    ``launch.generate`` flag that names a source; ``chains`` / ``trees``: budget ``auto``'s candidates;
    ``export_formats``: its ``runs.exports.ExportFormat`` records (``launch.export_head --format``);
    ``methods``: the ``--method`` names that draft with it. How the family trains (its task, configs) is
    not here — decoding never reaches into training — but in its ``confu_jax.catalog`` entry."""

    name: str
    parse: Callable[[str], Any]
    load: Callable[..., Any]
    methods: tuple = ()
    chains: tuple = DEFAULT_CHAINS
    trees: tuple = DEFAULT_TREES
    max_depth: Optional[Callable[[Any], Optional[int]]] = None
    reads_step: bool = False
    source_flag: str = "draft_ckpt"
    export_formats: tuple = ()

    def default_plan(self, drafter_params=None) -> str:
        """The plan a CLI drafts with when none is given: chain:4, or as deep as ``drafter_params`` allow."""
        limit = None if self.max_depth is None or drafter_params is None else self.max_depth(drafter_params)
        return f"chain:{DEFAULT_DEPTH if limit is None else min(DEFAULT_DEPTH, limit)}"


@dataclasses.dataclass(frozen=True)
class SourceKind:
    """One kind of folder a family reads its weights from: ``matches(path)`` tells it, ``read(path)``
    reads it, ``what`` names it in the error when no kind matches."""

    what: str
    matches: Callable[[str], bool]
    read: Callable[[str], Any]


def source_path(source: str) -> str:
    """A weights source as an absolute path (local or gs://, ``~`` expanded)."""
    from confu_jax import storage

    return storage.absolute(os.path.expanduser(source))


def resolve_source(source: str, kinds: Sequence[SourceKind]) -> Any:
    """What the first matching kind reads from a family's weights source (made absolute: local or
    gs://, ``~`` expanded; each kind gets the absolute path). No kind matching is one error naming every kind the family reads."""
    path = source_path(source)
    for kind in kinds:
        if kind.matches(path):
            return kind.read(path)
    raise ValueError(f"{source}: neither " + " nor ".join(k.what for k in kinds))


def own_weights_loader(load_own: Callable[..., Any]) -> Callable[..., Any]:
    """The ``DrafterFamily.load`` of a family whose weights are its own tree (Medusa, the MLP
    speculator, MTP, DFlash): ``load_own(target_cfg, target_params, source, seed, target_source=...)``;
    such runs load their latest step, and their checkpoints share the target's tokenizer by construction."""

    def load(method, target_cfg, target_params, source, *, seed=0, step=None, target_source="the loaded target",
             target_tokenizer=None):
        del method, step, target_tokenizer
        return load_own(target_cfg, target_params, source, seed, target_source=target_source)

    return load
