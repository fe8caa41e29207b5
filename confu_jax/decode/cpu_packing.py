"""Which of a drafter's weights the CPU decode path packs for the few-row matmul (``kernels.cpu_matmul``)
where it packed the target: a backend policy, kept out of the ``Drafter`` contract.

Why here: packing is the CPU backend's business (the unrolled path packs the target's projections,
``models.unrolled.prepared_layers``); a drafter family knows only that some of its weights are
``models.llama.PackableDense`` modules nothing else reads. A family with such weights registers which
(``register``: EAGLE-3 / ConFu heads their dense projections, the hybrid its head's); every other
drafter's weights stay as they are. The loop asks ``packable_draft`` once per target, outside the
compiled program (``decode.loop._placed``).
"""

from __future__ import annotations

from typing import Any, Callable

_PACKABLE: dict = {}  # drafter class -> (drafter -> names of its packable modules in dp.weights)


def register(drafter_class: type, names: Callable[[Any], tuple]) -> None:
    """``names(drafter)``: the modules of ``dp.weights`` this class's drafters let the CPU path pack."""
    _PACKABLE[drafter_class] = names


def packable_draft(drafter) -> tuple:
    """Names of ``drafter``'s packable modules (its class's registration, or its nearest base's); ()
    keeps its weights as they are."""
    for cls in type(drafter).__mro__:
        if cls in _PACKABLE:
            return tuple(_PACKABLE[cls](drafter))
    return ()
