"""The one registry of head variants (what is trained) and decoding methods (what decodes).

A **variant** is an architecture of the draft head and its target-side extras; a **method** is
what a user asks to decode with (``--method``/``--methods``), which accepts heads of some variants.
Every table of names in the code (config validation, CLI choices, head loading, benchmark rows)
reads these two dicts, so adding a variant is one entry here.
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


FAMILIES = ("ar", "head", "lookup", "hybrid", "auto", "draft_model", "sd2", "medusa", "mlp_speculator",
            "mtp", "dflash")  # drafter families (decode.families maps them to classes)


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    variants: tuple  # head variants it decodes with (the first one for random heads); () = no head
    description: str
    family: str = "head"  # one of FAMILIES: how it drafts (decode.families.FAMILIES holds its record)
    own_weights: bool = False  # a head of its own kind (Medusa, MLP speculator, MTP, DFlash): no variant

    @property
    def speculative(self) -> bool:
        return self.family != "ar"

    @property
    def chooses_method(self) -> bool:
        """Benchmark-only ``auto``: budget auto picks the family and plan among the run's other methods."""
        return self.family == "auto"

    @property
    def needs_head(self) -> bool:
        """Whether it drafts with a trained (or untrained) head: a workdir / imported head to load."""
        return bool(self.variants) or self.own_weights


VARIANTS: dict = {v.name: v for v in (
    Variant("eagle3", False, False, False, "EAGLE-3 draft head; no contemplate tokens, no extra params"),
    Variant("confu", True, True, True, "ConFu: soft prompts + MoE_con in the target, MoE_f future token"),
    Variant("confu_nomoe", True, False, True, "ConFu with one static embedding instead of each MoE (-MoE)"),
    Variant("confu_nomoe_norep", True, False, False,
            "-MoE, trained without the replication window (-MoE & replicate)"),
)}

METHODS: dict = {m.name: m for m in (
    Method("ar", (), "autoregressive decoding: one target pass per token (the baseline)", "ar"),
    Method("eagle3", ("eagle3",), "speculative decoding with an EAGLE-3 head"),
    Method("confu", ("confu", "confu_nomoe", "confu_nomoe_norep"), "speculative decoding with a ConFu head"),
    Method("confu_nomoe", ("confu_nomoe", "confu_nomoe_norep"), "ConFu -MoE ablation"),
    Method("confu_nomoe_norep", ("confu_nomoe_norep",), "ConFu -MoE & replicate ablation"),
    Method("lookup", (), "model-free prompt lookup: n-gram matches in the prompt and the generated text", "lookup"),
    Method("hybrid", ("eagle3", "confu", "confu_nomoe", "confu_nomoe_norep"),
           "prompt lookup where it matches, the head (EAGLE-3 or ConFu) elsewhere, per row", "hybrid"),
    Method("draft_model", (), "an independent draft model sharing the target's tokenizer (self:N = the target's "
           "first N layers, or a GGUF / HF checkpoint), with its own KV cache", "draft_model"),
    Method("sd2", (), "SD²: a draft model steered by the target's hidden states (trained with configs/*_sd2.py)",
           "sd2"),
    Method("medusa", (), "Medusa-1 heads on the target's last hidden state (trained with configs/*_medusa.py, or a "
           "FasterDecoding medusa_lm_head directory)", "medusa", own_weights=True),
    Method("mlp_speculator", (), "IBM's MLP speculator: recurrent stages on the target's last hidden state and the "
           "drafted tokens (trained with configs/*_mlp_speculator.py, or an fms / vLLM mlp_speculator directory)",
           "mlp_speculator", own_weights=True),
    Method("mtp", (), "DeepSeek-V3's MTP module: one Llama layer on the target's last hidden state and the next "
           "token, the target's embedding and LM head, drafting recursively (trained with configs/*_mtp.py, or a "
           "DeepSeek-layout MTP directory)", "mtp", own_weights=True),
    Method("dflash", (), "DFlash: a block-diffusion draft drafting a whole block in one forward, conditioned on the "
           "target's taps as extra K/V (trained with configs/*_dflash.py, or a z-lab DFlash directory)", "dflash",
           own_weights=True),
    Method("auto", (), "benchmark only: budget auto across the run's other methods (family and plan)", "auto"),
)}

SPECULATIVE_METHODS = tuple(name for name, m in METHODS.items() if m.speculative)


def get_variant(name: str) -> Variant:
    if name not in VARIANTS:
        raise ValueError(f"unknown head variant {name!r}; expected one of {tuple(VARIANTS)}")
    return VARIANTS[name]


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"unknown decoding method {name!r}; expected one of {tuple(METHODS)}")
    return METHODS[name]
