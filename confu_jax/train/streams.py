"""What a training task's data is to the loop: an iterator over this process's rows whose position
checkpoints exactly (:class:`DataIterator`), and the deterministic form most tasks use
(:class:`PositionStream`: batch ``i`` a function of the seed and ``i``). Below every task and data
source, so they import it without importing each other."""

from __future__ import annotations

from typing import Any, Iterator, Protocol


class DataIterator(Protocol):
    """Per-process batch iterator whose position can be checkpointed exactly.

    ``next()`` returns THIS process's rows of the global batch (global rows / process_count) as a
    dict of numpy arrays. ``get_state()`` returns a JSON-able dict (or bytes) and
    ``set_state(state)`` restores it: the batches after a restore are those that followed the save.
    """

    def __iter__(self) -> Iterator[dict]: ...

    def __next__(self) -> dict: ...

    def get_state(self) -> Any: ...

    def set_state(self, state: Any) -> None: ...


class PositionStream:
    """A deterministic batch stream: batch ``i`` is a function of (seed, i) only, so the iterator's
    checkpointable state is its position. Subclasses set ``seed``, ``position`` and
    ``seed_setting`` (the config key named when a restored seed differs) and define ``batch_at``."""

    seed: int
    position: int = 0
    seed_setting: str = "seed"

    def batch_at(self, index: int) -> dict:
        raise NotImplementedError

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = self.batch_at(self.position)
        self.position += 1
        return batch

    def get_state(self) -> dict:
        return {"position": int(self.position), "seed": int(self.seed)}

    def set_state(self, state: dict) -> None:
        if int(state["seed"]) != self.seed:
            raise ValueError(f"data state seed {state['seed']} != configured {self.seed_setting} {self.seed}")
        self.position = int(state["position"])
