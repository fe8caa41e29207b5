"""The drafter families, one record each: everything the CLIs, the benchmark and budget ``auto`` ask
about a family by name is a field of its ``DrafterFamily`` here, so no other module switches on a
family's name.

A method (``models.registry.METHODS``: what ``--method`` names) belongs to one family
(``Method.family``); ``family_of(method)`` returns its record. A record says how the family

* reads a plan text into a frozen ``Drafter`` (``parse``; errors list the forms it accepts),
* loads what it drafts with from a source — a ``launch.train`` workdir, a release, a published
  layout, a draft-model path — or initialises it when there is none (``load``), and whether a
  source may name one checkpoint step (``reads_step``) and which ``launch.generate`` flag names it
  (``source_flag``),
* drafts by default and how deep its weights let it (``default_plan``, ``max_depth``),
* is swept by budget ``auto`` (``chains``, ``trees``: the candidate plans),
* is exported (``export_formats``: ``launch.export_head --format``) and trained
  (``train_task``: the ``config.train.task`` entry point, ``configs``: the shipped configs,
  ``tiny_config``: the shipped config that trains on a random tiny target in seconds — quick checks of a
  setup, and the contract test's kill-and-resume and export round trip — ``packs_rows``: whether its
  training runs on packed rows).

Adding a family: its own modules, then one record in ``FAMILIES`` (docs/families.md "Adding a
family"); ``tests/test_families.py`` checks every record's contract.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from confu_jax.decode import heads
from confu_jax.decode.dflash import DFlashDrafter, parse_dflash_plan
from confu_jax.decode.draft_model import DraftModel
from confu_jax.decode.drafter import Drafter
from confu_jax.decode.drafting import HeadDrafter
from confu_jax.decode.hybrid import Hybrid
from confu_jax.decode.lookup import PromptLookup
from confu_jax.decode.medusa import MedusaDrafter, parse_medusa_plan
from confu_jax.decode.mlp_speculator import MLPSpeculatorDrafter, parse_mlp_speculator_plan
from confu_jax.decode.mtp import MTPDrafter, parse_mtp_plan
from confu_jax.decode.plans import Chain, parse_plan
from confu_jax.models.registry import METHODS, get_method

# budget auto's default candidates (chains, then trees; bench.budget)
DEFAULT_CHAINS = tuple(f"chain:{k}" for k in range(1, 8))
# EAGLE-2-style dynamic trees with T-1 = 4, 8, 16, 30, 60 non-root nodes
DEFAULT_TREES = ("dynamic:3,2,4", "dynamic:4,4,8", "dynamic:5,6,16", "dynamic:6,8,30", "dynamic:6,10,60")
# prompt lookup: chains of 2..8 and tries of 2 / 4 continuations
LOOKUP_CHAINS = tuple(f"chain:{k}" for k in (2, 3, 4, 6, 8))
DEFAULT_LOOKUP_TREES = ("lookup:4,2", "lookup:6,2", "lookup:4,4")
# per-depth top-k (Medusa's heads, the MLP speculator's stages, DFlash's block positions): Cartesian
# trees, depth <= 3 (the shipped tiny configs have 3 heads / stages)
DEFAULT_CARTESIAN_TREES = ("tree:2,2", "tree:3,2,1", "tree:4,3,2", "dynamic:3,2,4")

LOOKUP_FORMS = "chain:K or lookup:K[,W[,NMIN,NMAX]] (e.g. chain:3, lookup:4,2, lookup:4,1,3,5)"
DEFAULT_DEPTH = 4  # the default plan drafts chain:4, or as deep as the family's weights allow


@dataclasses.dataclass(frozen=True)
class DrafterFamily:
    """One drafter family (module docstring). ``load(method, target_cfg, target_params, source, *,
    seed, step, target_source, target_tokenizer) -> decode.heads.DecodeHead``; ``max_depth(params)``
    -> the deepest plan the loaded weights draft (None: any)."""

    name: str
    parse: Callable[[str], Drafter]
    load: Callable[..., heads.DecodeHead]
    chains: tuple = DEFAULT_CHAINS
    trees: tuple = DEFAULT_TREES
    max_depth: Optional[Callable[[Any], Optional[int]]] = None
    reads_step: bool = False
    source_flag: str = "draft_ckpt"
    export_formats: tuple = ()
    train_task: Optional[str] = None
    configs: tuple = ()
    tiny_config: Optional[str] = None  # ``path.py`` or ``path.py:parameter`` (ml_collections' config-flag form)
    # its training is run on packed rows (``data.pack``) where a caller packs; False: padded rows (the
    # task refuses packing, or its packed path is untested: DFlash)
    packs_rows: bool = False

    def default_plan(self, params=None) -> str:
        """The plan a CLI drafts with when none is given: chain:4, or as deep as ``params`` allow."""
        limit = None if self.max_depth is None or params is None else self.max_depth(params)
        return f"chain:{DEFAULT_DEPTH if limit is None else min(DEFAULT_DEPTH, limit)}"


# ----------------------------------------------------------------------------- plan readers


def parse_lookup(text: str) -> PromptLookup:
    kind, _, arg = text.partition(":")
    try:
        vals = [int(x) for x in arg.split(",")] if arg else []
        if kind == "chain" and len(vals) == 1:
            return PromptLookup(k=vals[0])
        if kind == "lookup" and len(vals) in (1, 2, 4):
            k, w = vals[0], (vals[1] if len(vals) > 1 else 1)
            if len(vals) == 4:
                return PromptLookup(k=k, branches=w, min_match=vals[2], max_match=vals[3])
            return PromptLookup(k=k, branches=w)
    except ValueError as e:
        raise ValueError(f"bad lookup plan {text!r}: {e}. Expected {LOOKUP_FORMS}") from None
    raise ValueError(f"bad lookup plan {text!r}: expected {LOOKUP_FORMS}")


def parse_head(text: str) -> HeadDrafter:
    """A head plan, optionally ``@P`` (confidence-gated width, chains only)."""
    body, at, prob = text.partition("@")
    plan = parse_plan(body)
    if not at:
        return HeadDrafter(plan)
    try:
        p = float(prob)
    except ValueError:
        raise ValueError(f"bad plan {text!r}: @P needs a probability in (0, 1), e.g. chain:4@0.5") from None
    if not 0 < p < 1:
        raise ValueError(f"bad plan {text!r}: @P needs a probability in (0, 1), got {p}")
    return HeadDrafter(plan, min_prob=p)


def parse_hybrid(text: str) -> Hybrid:
    head = parse_head(text)
    if not isinstance(head.plan, Chain) or head.plan.contemplates:
        raise ValueError(f"hybrid decoding drafts chains (chain:K or chain:K@P); got {text!r}")
    return Hybrid(head=head, lookup=PromptLookup(k=head.plan.k))


def _parse_draft_model(text: str) -> DraftModel:
    return DraftModel(parse_plan(text, what="a draft model"))


def _parse_sd2(text: str) -> DraftModel:
    return DraftModel(parse_plan(text, what="a draft model"), steered=True)


# ----------------------------------------------------------------------------- loaders


def _load_head(method, target_cfg, target_params, source, *, seed=0, step=None, target_source="the loaded target",
               target_tokenizer=None):
    """An EAGLE-3 / ConFu head: trained (workdir, release or exported layout) or random."""
    del target_tokenizer
    if source:
        return heads.trained_head(method, source, target_cfg, target_params, step=step, target_source=target_source)
    return heads.random_head(method, target_cfg, target_params, seed)


def _load_model_free(method, target_cfg, target_params, source, **kw):
    del kw
    if source:
        raise ValueError(f"method {method!r} is model-free: it takes no head (got {source})")
    return heads.model_free(target_cfg, target_params)


def _draft_model_loader(steered: bool):
    """An independent draft model (``self:N``, a checkpoint, an SD² run), steered (SD²) or not."""

    def load(method, target_cfg, target_params, source, *, seed=0, step=None, target_source="the loaded target",
             target_tokenizer=None):
        del method, seed, step
        return heads.draft_model_head(target_cfg, target_params, source, steered=steered,
                                      target_tokenizer=target_tokenizer, target_source=target_source)

    return load


def _own_head(loader):
    """A family whose weights are its own tree (Medusa, the MLP speculator, MTP, DFlash): its
    ``launch.train`` workdir or published layout, else a random init."""

    def load(method, target_cfg, target_params, source, *, seed=0, step=None, target_source="the loaded target",
             target_tokenizer=None):
        del method, step, target_tokenizer
        return loader(target_cfg, target_params, source, seed, target_source=target_source)

    return load


def _medusa_depth(params) -> int:
    from confu_jax.models.medusa import config_of

    return config_of(params.draft["medusa"]).num_heads


def _mlp_speculator_depth(params) -> int:
    from confu_jax.models.mlp_speculator import config_of

    return config_of(params.draft["mlp_speculator"]).n_predict


# ----------------------------------------------------------------------------- the registry


FAMILIES: dict = {f.name: f for f in (
    DrafterFamily("head", parse_head, _load_head, reads_step=True, export_formats=("eagle3", "speculators"),
                  train_task="confu_jax.train.confu_task:build_task",
                  configs=("configs/smollm2_eagle3.py", "configs/smollm2_confu.py"),
                  tiny_config="configs/tiny.py:eagle3",
                  packs_rows=True),
    DrafterFamily("lookup", parse_lookup, _load_model_free, chains=LOOKUP_CHAINS, trees=DEFAULT_LOOKUP_TREES),
    DrafterFamily("hybrid", parse_hybrid, _load_head, trees=(), reads_step=True),
    DrafterFamily("draft_model", _parse_draft_model, _draft_model_loader(False), source_flag="draft_model"),
    DrafterFamily("sd2", _parse_sd2, _draft_model_loader(True), source_flag="draft_model",
                  train_task="confu_jax.train.sd2_task:build_task", configs=("configs/smollm2_sd2.py",),
                  tiny_config="configs/tiny_sd2.py"),
    DrafterFamily("medusa", lambda text: MedusaDrafter(parse_medusa_plan(text)), _own_head(heads.medusa_head),
                  chains=DEFAULT_CHAINS[:3], trees=DEFAULT_CARTESIAN_TREES, max_depth=_medusa_depth,
                  export_formats=("medusa",), train_task="confu_jax.train.medusa_task:build_task",
                  configs=("configs/smollm2_medusa.py",), tiny_config="configs/tiny_medusa.py"),
    DrafterFamily("mlp_speculator", lambda text: MLPSpeculatorDrafter(parse_mlp_speculator_plan(text)),
                  _own_head(heads.mlp_speculator_head), chains=DEFAULT_CHAINS[:3], trees=DEFAULT_CARTESIAN_TREES,
                  max_depth=_mlp_speculator_depth, export_formats=("mlp_speculator",),
                  train_task="confu_jax.train.mlp_speculator_task:build_task",
                  configs=("configs/smollm2_mlp_speculator.py",), tiny_config="configs/tiny_mlp_speculator.py"),
    DrafterFamily("mtp", lambda text: MTPDrafter(parse_mtp_plan(text)), _own_head(heads.mtp_head),
                  export_formats=("mtp",), train_task="confu_jax.train.mtp_task:build_task",
                  configs=("configs/smollm2_mtp.py",), tiny_config="configs/tiny_mtp.py", packs_rows=True),
    DrafterFamily("dflash", lambda text: DFlashDrafter(parse_dflash_plan(text)), _own_head(heads.dflash_head),
                  trees=DEFAULT_CARTESIAN_TREES, export_formats=("dflash",),
                  train_task="confu_jax.train.dflash_task:build_task", configs=("configs/smollm2_dflash.py",),
                  tiny_config="configs/tiny_dflash.py"),
)}


def family_of(method: str) -> DrafterFamily:
    """The record of the family ``method`` drafts with (errors name the methods that draft)."""
    fam = get_method(method).family
    if fam not in FAMILIES:
        drafting = sorted(name for name, m in METHODS.items() if m.family in FAMILIES)
        raise ValueError(f"method {method!r} does not draft (family {fam!r}); the drafting methods: {drafting}")
    return FAMILIES[fam]


def parse_drafter(method: str, text: str) -> Drafter:
    """The drafter ``method`` decodes with under the plan ``text`` (errors list the accepted forms)."""
    return family_of(method).parse(text)


def export_formats() -> tuple:
    """Every ``launch.export_head --format``, family by family."""
    return tuple(f for fam in FAMILIES.values() for f in fam.export_formats)


def decode_head(method: str, target_cfg, target_params: dict, workdir: Optional[str] = None, seed: int = 0,
                target_source: str = "the loaded target", target_tokenizer=None) -> heads.DecodeHead:
    """What ``method`` drafts with (``DrafterFamily.load``): a trained head from ``workdir`` (a
    ``launch.train`` workdir, ``WORKDIR@STEP`` where the family reads steps, a release or a published
    layout), a random one, nothing (model-free methods, which refuse a source), or a draft model
    (``target_tokenizer`` checks an external model's tokenizer)."""
    fam = family_of(method)
    workdir, step = heads.split_step(workdir)
    if step is not None and not fam.reads_step:
        raise ValueError(f"{workdir}@{step}: a checkpoint step (WORKDIR@STEP) is read for EAGLE-3 / ConFu "
                         f"heads only; method {method!r} (family {fam.name}) loads its run's latest step")
    return fam.load(method, target_cfg, target_params, workdir, seed=seed, step=step, target_source=target_source,
                    target_tokenizer=target_tokenizer)
