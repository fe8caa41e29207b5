"""The registry of EAGLE-3 / ConFu head variants (what is trained): an architecture of the draft head
and its target-side extras. Config validation, head loading and the methods that decode them
(``decode.family.Method.variants``; the methods themselves are declared by each drafter family's
module, ``decode.families``) read this dict, so adding a variant is one entry here.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    has_future: bool  # contemplate tokens in the target, the future entry in the draft
    uses_moe: bool  # [con] and [f] from an embedding MoE (else one static embedding each)
    replication: bool  # training uses ConFu's replication window (config.confu.replication)
    description: str
    parallel: bool = False  # P-EAGLE: one pass drafts every depth (mask slots read a learned mask_hidden)


VARIANTS: dict = {v.name: v for v in (
    Variant("eagle3", False, False, False, "EAGLE-3 draft head; no contemplate tokens, no extra params"),
    Variant("confu", True, True, True, "ConFu: soft prompts + MoE_con in the target, MoE_f future token"),
    Variant("confu_nomoe", True, False, True, "ConFu with one static embedding instead of each MoE (-MoE)"),
    Variant("confu_nomoe_norep", True, False, False,
            "-MoE, trained without the replication window (-MoE & replicate)"),
    Variant("peagle", False, False, False, "P-EAGLE: EAGLE-3's head drafting every depth in one pass (slots after "
            "the first read the mask token and a learned mask_hidden in place of target features)", parallel=True),
)}


def get_variant(name: str) -> Variant:
    if name not in VARIANTS:
        raise ValueError(f"unknown head variant {name!r}; expected one of {tuple(VARIANTS)}")
    return VARIANTS[name]
