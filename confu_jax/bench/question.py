"""One benchmark question (:class:`BenchPrompt`) and the error a malformed question file raises: the
type every prompt source (``bench.prompts``, ``bench.grounded``) builds, kept below them."""

from __future__ import annotations

import dataclasses


class QuestionFileError(ValueError):
    """A question file that does not follow the MT-Bench / Spec-Bench ``question.jsonl`` format."""


@dataclasses.dataclass(frozen=True)
class BenchPrompt:
    """One benchmark question: its id, its category (the report's grouping key) and user turns."""

    question_id: int | str
    category: str
    turns: tuple[str, ...]

    def __post_init__(self):
        object.__setattr__(self, "turns", tuple(self.turns))
