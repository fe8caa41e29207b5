"""The grounded benchmark set: prompts whose answer copies from the input (docs/DESIGN.md §11).

Model-free drafters (prompt lookup) pay where the answer repeats its context: summaries, answers
drawn from a given passage, rewrites and code edits. Spec-Bench's summarization and RAG splits are
not installable here, so this set is built, deterministically, from the installed datasets:

* ``summarize``  — a passage (a ShareGPT assistant answer of 500-1500 characters, prose: no code
  fence) with "Summarize the following text in a few sentences.";
* ``answer_from`` — the same kind of passage with "Using only the text above, list the main points
  it makes, quoting it where you can.";
* ``rewrite``    — a passage with "Rewrite the following text so that it is clearer, keeping its
  meaning and most of its wording.";
* ``code_edit``  — a HumanEval problem with its canonical solution and "Add type hints and a comment
  to every line of this function. Return the complete function."

Passages come from the last ShareGPT conversations in file order (the end that
``data.formats.split_held_out`` holds out of training) and HumanEval's last problems (HumanEval's
first problems are in ``--prompts humaneval:N``). Question ids are ``grounded/<category>/<i>``.
"""

from __future__ import annotations

import gzip
import json

from confu_jax import assets
from confu_jax.bench.question import BenchPrompt

GROUNDED_CATEGORIES = ("summarize", "answer_from", "rewrite", "code_edit")
PASSAGE_CHARS = (500, 1500)
INSTRUCTIONS = {
    "summarize": "Summarize the following text in a few sentences.\n\n{passage}",
    "answer_from": "{passage}\n\nUsing only the text above, list the main points it makes, quoting it where you can.",
    "rewrite": "Rewrite the following text so that it is clearer, keeping its meaning and most of its wording.\n\n"
               "{passage}",
    "code_edit": "Add type hints and a comment to every line of this function. Return the complete function.\n\n"
                 "```python\n{passage}\n```",
}


def sharegpt_passages(n: int) -> list[str]:
    """``n`` prose passages from the last ShareGPT conversations (one per conversation, the first
    assistant answer whose length lies in PASSAGE_CHARS and that holds no code fence)."""
    from confu_jax.data.formats import load_conversations

    convs, _ = load_conversations("sharegpt")
    out: list[str] = []
    for conv in reversed(convs):
        for m in conv["messages"]:
            text = m["content"].strip()
            if m["role"] == "assistant" and PASSAGE_CHARS[0] <= len(text) <= PASSAGE_CHARS[1] and "```" not in text:
                out.append(text)
                break
        if len(out) == n:
            return out
    raise ValueError(f"ShareGPT holds only {len(out)} usable passages; {n} asked for")


def humaneval_solutions(n: int) -> list[str]:
    """The last ``n`` HumanEval problems with their canonical solutions (complete functions)."""
    path = assets.resolve("humaneval")
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        recs = [json.loads(line) for line in f if line.strip()]
    return [(r["prompt"] + r["canonical_solution"]).strip() for r in recs[-n:]]


def load_grounded(n_per_category: int = 10) -> list[BenchPrompt]:
    """The grounded set: ``n_per_category`` prompts in each of GROUNDED_CATEGORIES (single turn)."""
    passages = sharegpt_passages(3 * n_per_category)
    code = humaneval_solutions(n_per_category)
    sources = {"summarize": passages[:n_per_category],
               "answer_from": passages[n_per_category: 2 * n_per_category],
               "rewrite": passages[2 * n_per_category:], "code_edit": code}
    return [BenchPrompt(f"grounded/{cat}/{i}", cat, (INSTRUCTIONS[cat].format(passage=text),))
            for cat in GROUNDED_CATEGORIES for i, text in enumerate(sources[cat])]
