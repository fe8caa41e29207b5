"""A training run's held-out conversations as a benchmark question file: ``python -m launch.heldout_questions``.

    python -m launch.heldout_questions --data runs/headline/data/regen.jsonl --out heldout.jsonl --n 32
    python -m launch.decode_bench --methods ar,eagle3 --heads eagle3=runs/headline/eagle3 \
        --prompts heldout.jsonl --n_per_category 0 --max_new_tokens 224 --temperatures 0 --budgets chain:4

Why: training reports a simulated τ (``eval/acceptance_length``) on the conversations it holds out
(the last ``objective.eval_records`` of its data files); the decode benchmark measures τ on other
prompts (MT-Bench, HumanEval). When the two disagree, decoding the *same* held-out prompts tells a
distribution shift (benchmark prompts unlike the training data) from a mismatch between training
and the decode loop: on self-distilled data decoded greedily, the loop regenerates the held-out
answers themselves, so its τ at chain depth L_ttt should match the simulated one.

Each held-out conversation becomes one question: its user turns up to the first assistant answer
(the prompt the target answered; a system turn is dropped with a count, since question files have
none), category ``--category``, ``question_id`` = the conversation's id.
"""

from __future__ import annotations

import json

from absl import flags, logging

from confu_jax import storage

flags.DEFINE_list("data", None, "training data files, as in config.data.train_files", required=True)
flags.DEFINE_string("out", None, "question.jsonl to write", required=True)
flags.DEFINE_integer("eval_records", 64, "held-out tail, as config.objective.eval_records")
flags.DEFINE_integer("n", 0, "keep the first N held-out conversations (0: all)")
flags.DEFINE_string("category", "heldout", "category written for every question")
FLAGS = flags.FLAGS


def heldout_questions(conversations, eval_records: int, n: int = 0, category: str = "heldout") -> tuple[list[dict], int]:
    """(question records, system turns dropped) for the held-out tail of ``conversations``."""
    from confu_jax.data.formats import split_held_out

    _, held = split_held_out(conversations, eval_records)
    out, n_system = [], 0
    for conv in held:
        turns = []
        for m in conv["messages"]:
            if m["role"] == "assistant":
                break
            if m["role"] == "system":
                n_system += 1
                continue
            turns.append(m["content"])
        if not turns:
            continue
        out.append({"question_id": str(conv["id"]), "category": category, "turns": ["\n\n".join(turns)]})
        if n and len(out) == n:
            break
    return out, n_system


def main(argv):
    del argv
    from confu_jax.data import formats

    conversations, report = formats.load_conversations(FLAGS.data)
    logging.info("data: %s", report.summary())
    questions, n_system = heldout_questions(conversations, FLAGS.eval_records, FLAGS.n, FLAGS.category)
    if not questions:
        raise SystemExit(f"{','.join(FLAGS.data)}: no held-out conversation with a user turn "
                         f"({len(conversations)} conversations, eval_records={FLAGS.eval_records})")
    storage.write_text(FLAGS.out, "".join(json.dumps(q, ensure_ascii=False) + "\n" for q in questions))
    msg = f"wrote {len(questions)} held-out questions to {FLAGS.out}"
    if n_system:
        msg += f" ({n_system} system turns dropped)"
    print(msg)


if __name__ == "__main__":
    from confu_jax.user_errors import run

    run("launch.heldout_questions", main)
