"""Every drafter family by name: a method (``models.registry``) and a plan text -> a ``Drafter``.

The CLIs, the benchmark and budget ``auto`` name drafters by two strings, the method
(``--method lookup``) and the plan (``--tree chain:3``); this module is the one place that turns
them into the frozen ``Drafter`` classes the loop takes (docs/DESIGN.md §11). Plan texts:

* head methods (``eagle3``, ``confu``, ...): ``decode.plans.parse_plan`` (``chain:K``,
  ``sampled_chain:K``, ``dynamic:D,K,N``, ``+cM``), and ``chain:K@P`` for a confidence-gated width
  (``HeadDrafter.min_prob``: only drafts of cumulative draft probability >= P are verified);
* ``lookup``: ``chain:K`` or ``lookup:K[,W[,NMIN,NMAX]]`` — K tokens per branch, W distinct
  continuations (a trie), matches of NMIN..NMAX tokens (defaults: W = 1, 2..4);
* ``hybrid`` (lookup where it matches, the head elsewhere): ``chain:K`` or ``chain:K@P``;
* ``draft_model`` (an independent draft model) and ``sd2`` (the same, steered): the head forms
  without ``+cM`` (``chain:K``, ``sampled_chain:K``, ``dynamic:D,K,N``);
* ``medusa`` (Medusa-1 heads): the same, plus ``tree:k1,...,kD`` (head i's top-k_i, Cartesian);
* ``mlp_speculator`` (IBM's MLP speculator): as ``medusa`` (``tree:k1,...,kD`` = stage i's top-k_i
  under every node, the reference's ``top_k_tokens_per_head``);
* ``mtp`` (DeepSeek-V3's MTP module): as ``mlp_speculator`` (``tree:k1,...,kD`` = depth i's top-k_i
  under every node);
* ``dflash`` (a DFlash block-diffusion draft): as ``medusa`` (``chain:K`` = a block of K+1,
  ``tree:k1,...,kD`` = block position i's top-k_i).
"""

from __future__ import annotations

from typing import Optional

from confu_jax.decode.dflash import DFlashDrafter, parse_dflash_plan
from confu_jax.decode.draft_model import DraftModel
from confu_jax.decode.drafter import Drafter
from confu_jax.decode.drafting import HeadDrafter
from confu_jax.decode.hybrid import Hybrid
from confu_jax.decode.lookup import PromptLookup
from confu_jax.decode.medusa import MedusaDrafter, parse_medusa_plan
from confu_jax.decode.mlp_speculator import MLPSpeculatorDrafter, parse_mlp_speculator_plan
from confu_jax.decode.mtp import MTPDrafter, parse_mtp_plan
from confu_jax.decode.plans import DraftPlan, parse_plan
from confu_jax.models.registry import get_method

LOOKUP_FORMS = "chain:K or lookup:K[,W[,NMIN,NMAX]] (e.g. chain:3, lookup:4,2, lookup:4,1,3,5)"


def max_draft_depth(params) -> Optional[int]:
    """How deep the drafter of ``params`` (``SpecParams``) can draft, where its parameters bound it —
    Medusa's heads, the MLP speculator's stages — else None (any depth): a CLI's default plan fits it."""
    from confu_jax.models.medusa import config_of as medusa_config
    from confu_jax.models.mlp_speculator import config_of as mlp_speculator_config

    draft = getattr(params, "draft", None) or {}
    if isinstance(draft, dict) and "medusa" in draft:
        return medusa_config(draft["medusa"]).num_heads
    if isinstance(draft, dict) and "mlp_speculator" in draft:
        return mlp_speculator_config(draft["mlp_speculator"]).n_predict
    return None


def as_drafter(drafter) -> Drafter:
    """A ``Drafter`` as is; a ``DraftPlan`` as the head drafter of the loop's spec."""
    if isinstance(drafter, Drafter):
        return drafter
    if isinstance(drafter, DraftPlan):
        return HeadDrafter(drafter)
    raise TypeError(f"expected a decode.drafter.Drafter or a DraftPlan, got {type(drafter).__name__}: {drafter!r}")


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


def parse_drafter(method: str, text: str) -> Drafter:
    """The drafter ``method`` decodes with under the plan ``text`` (errors list the accepted forms)."""
    family = get_method(method).family
    if family == "head":
        return parse_head(text)
    if family == "lookup":
        return parse_lookup(text)
    if family == "hybrid":
        head = parse_head(text)
        if head.plan.kind != "chain" or head.plan.contemplates:
            raise ValueError(f"hybrid decoding drafts chains (chain:K or chain:K@P); got {text!r}")
        return Hybrid(head=head, lookup=PromptLookup(k=head.plan.k))
    if family in ("draft_model", "sd2"):
        plan = parse_plan(text)
        if plan.contemplates:
            raise ValueError(f"a draft model has no contemplates: {text!r} (drop +cM)")
        return DraftModel(plan, steered=family == "sd2")
    if family == "medusa":
        return MedusaDrafter(parse_medusa_plan(text))
    if family == "mlp_speculator":
        return MLPSpeculatorDrafter(parse_mlp_speculator_plan(text))
    if family == "mtp":
        return MTPDrafter(parse_mtp_plan(text))
    if family == "dflash":
        return DFlashDrafter(parse_dflash_plan(text))
    raise ValueError(f"method {method!r} does not draft (family {family!r})")
