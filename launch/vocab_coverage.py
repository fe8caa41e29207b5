"""Draft-vocabulary coverage: which size to train with.

    python -m launch.vocab_coverage --data releases/data/sharegpt_smollm2 [--sizes 4096,8192,16384,32768]

Counts the answer tokens (the training loss's tokens, encoded exactly as training encodes them) of
the training split and of the held-out split (``data.formats.split_held_out``, the split training
evaluates on), builds the draft vocabulary of each size from the training counts
(``data.draft_vocab.build_draft_vocab``) and prints the fraction of answer tokens it covers on each
split. A token outside the draft vocabulary can never be drafted: the held-out coverage bounds every
draft step's acceptance, while the LM head's cost grows with the size.
"""

from __future__ import annotations

import json

from absl import flags

from confu_jax import storage

flags.DEFINE_list("data", ["releases/data/sharegpt_smollm2"], "conversation files, release folders or asset names")
flags.DEFINE_string("model", "smollm2-135m-instruct", "tokenizer source (the target)")
flags.DEFINE_list("sizes", ["4096", "8192", "16384", "32768"], "draft vocabulary sizes")
flags.DEFINE_integer("eval_records", 32, "held-out conversations (the last ones, as training holds them out)")
flags.DEFINE_integer("max_length", 512, "training row length: tokens past it are not counted")
flags.DEFINE_string("json_out", "", "also write the table as JSON")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    from confu_jax.data import formats
    from confu_jax.data.chat import ChatTokenizer
    from confu_jax.data.draft_vocab import count_answer_tokens, vocab_coverage

    tok = ChatTokenizer.load(FLAGS.model)
    convs, _ = formats.load_conversations(FLAGS.data)
    train, held = formats.split_held_out(convs, FLAGS.eval_records)

    def counts(rows):
        def enc():
            for c in rows:
                ids, mask = tok.encode_chat(c["messages"], add_generation_prompt=False)
                yield ids[:FLAGS.max_length], mask[:FLAGS.max_length]
        return count_answer_tokens(enc(), tok.vocab_size)

    table = vocab_coverage(counts(train), counts(held), [int(s) for s in FLAGS.sizes], tok.eos_ids)
    print(f"{len(train)} training / {len(held)} held-out conversations ({', '.join(FLAGS.data)})")
    print("| draft vocabulary | train coverage | held-out coverage |\n|---|---|---|")
    for r in table:
        print(f"| {r['size']} | {r['train']:.4f} | {r['eval']:.4f} |")
    if FLAGS.json_out:
        storage.write_text(FLAGS.json_out, json.dumps(
            {"data": FLAGS.data, "n_train": len(train), "n_eval": len(held), "coverage": table}, indent=1))


if __name__ == "__main__":
    from confu_jax.user_errors import run

    run("launch.vocab_coverage", main)
