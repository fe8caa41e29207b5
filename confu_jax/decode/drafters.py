"""``as_drafter``: what the loop accepts as a drafter — a ``Drafter``, or a bare ``DraftPlan``
meaning the head drafter of the loop's spec. Method names and plan texts become drafters in
``decode.families`` (one record per family)."""

from __future__ import annotations

from confu_jax.decode.drafter import Drafter
from confu_jax.decode.drafting import HeadDrafter
from confu_jax.decode.plans import DraftPlan


def as_drafter(drafter) -> Drafter:
    """A ``Drafter`` as is; a ``DraftPlan`` as the head drafter of the loop's spec."""
    if isinstance(drafter, Drafter):
        return drafter
    if isinstance(drafter, DraftPlan):
        return HeadDrafter(drafter)
    raise TypeError(f"expected a decode.drafter.Drafter or a DraftPlan, got {type(drafter).__name__}: {drafter!r}")
