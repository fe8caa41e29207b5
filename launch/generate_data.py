"""Self-distillation: regenerate every assistant turn with the target, write SpecForge JSONL.

    python -m launch.generate_data --output data/regen.jsonl \
        [--model smollm2-135m-instruct] [--input sharegpt,more.jsonl] [--max_records 1000] \
        [--batch_size 16] [--max_new_tokens 512] [--temperature 0] [--top_p 1] [--seed 0]

Why: a draft head is trained to imitate the *target's* next-token distribution, so training on the
target's own answers (instead of ShareGPT's ChatGPT answers) removes a distribution shift; EAGLE
recommends it. System and user turns are kept verbatim; assistant turns are regenerated in order,
each one conditioned on the *regenerated* earlier answers (the context the target produces at
inference). User turns after the last assistant turn are dropped (nothing to learn from them).

Generation is batched and jitted (``confu_jax.decode.generate.generate_ar``): a batch of
``--batch_size`` conversations regenerates its first answers in one call, then its second answers,
and so on. Batches are padded to ``--batch_size`` rows so each prompt-length bucket compiles once.

Output ``{"id", "conversations": [{"role", "content"}]}`` per line, append-only, flushed and fsynced
after every batch, so a killed run loses at most the batch in flight. Rerunning with the same
``--output`` resumes: ids already in the file are skipped, and a torn last line (killed mid-write)
is cut off first. Input ids must be unique (duplicates after the first are skipped, with a count).
A conversation whose prompt would exceed ``--max_prompt_len`` tokens stops at the answers it has;
one with no regenerated answer at all is not written (and is re-checked, cheaply, on resume).
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from typing import Callable, Iterable, Sequence

import numpy as np

log = logging.getLogger("generate_data")


# ----------------------------------------------------------------------------------------------
# Output file: resume bookkeeping


def read_done_ids(path: str) -> set[str]:
    """Ids already written to ``path``; a torn last line (no newline / invalid JSON) is cut off.

    Only the last line can be torn (append-only writes); a bad line elsewhere means the file is not
    ours, and resuming into it would be unsafe, so that raises.
    """
    if not os.path.exists(path):
        return set()
    done: set[str] = set()
    with open(path, "rb") as f:
        data = f.read()
    good_end = 0
    pos = 0
    lineno = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        lineno += 1
        line = data[pos : (nl if nl >= 0 else len(data))]
        try:
            rec = json.loads(line) if nl >= 0 else None
            rec_id = rec["id"] if isinstance(rec, dict) else None
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError):
            rec_id = None
        if rec_id is None:
            if nl >= 0 and nl + 1 < len(data):
                raise ValueError(
                    f"{path}:{lineno}: not a generated record ({line[:80]!r}); refusing to resume "
                    "into a file that was not written by generate_data"
                )
            break
        done.add(str(rec_id))
        good_end = nl + 1
        pos = nl + 1
    if good_end < len(data):
        log.warning("%s: cutting a torn last line (%d bytes) before resuming", path, len(data) - good_end)
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return done


def append_records(path: str, records: Iterable[dict]) -> int:
    """Append one JSON line per record and make it durable before returning."""
    n = 0
    with open(path, "a", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            n += 1
        f.flush()
        os.fsync(f.fileno())
    return n


# ----------------------------------------------------------------------------------------------
# Regeneration


def _assistant_slots(messages: Sequence[dict]) -> list[list[dict]]:
    """Split a conversation into the context chunks that precede each assistant turn."""
    chunks, cur = [], []
    for m in messages:
        if m["role"] == "assistant":
            chunks.append(cur)
            cur = []
        else:
            cur.append(m)
    return chunks


def regenerate_batch(
    convs: Sequence[dict],
    tokenizer,
    generate_fn: Callable[[list[list[int]], int], tuple[np.ndarray, np.ndarray, np.ndarray]],
    *,
    batch_size: int,
    max_prompt_len: int,
) -> list[dict | None]:
    """Regenerate every assistant turn of up to ``batch_size`` conversations, turn by turn.

    ``generate_fn(prompts, seed)`` -> (tokens [B, N], n_generated [B], is_eos_stop [B]) for exactly
    ``batch_size`` prompts. Returns one record per input (None when no answer could be generated).
    """
    if not 0 < len(convs) <= batch_size:
        raise ValueError(f"regenerate_batch: got {len(convs)} conversations for batch_size={batch_size}")
    slots = [_assistant_slots(c["messages"]) for c in convs]
    out_msgs: list[list[dict]] = [[] for _ in convs]
    n_answers = [0] * len(convs)
    alive = [True] * len(convs)
    eos = set(int(e) for e in tokenizer.eos_ids)
    for turn in range(max(len(s) for s in slots)):
        rows, prompts = [], []
        for i, s in enumerate(slots):
            if not alive[i] or turn >= len(s):
                continue
            context = out_msgs[i] + s[turn]
            ids, _ = tokenizer.encode_chat(context, add_generation_prompt=True)
            if len(ids) > max_prompt_len:
                alive[i] = False
                continue
            out_msgs[i] = context
            rows.append(i)
            prompts.append(ids)
        if not rows:
            break
        # Pad to a fixed batch so every call of a bucket reuses one compiled program. The seed is a
        # function of the batch's ids and the turn (not of run history), so rerunning the same
        # batch samples the same answers.
        padded = prompts + [prompts[0]] * (batch_size - len(prompts))
        seed = zlib.crc32(("|".join(convs[i]["id"] for i in rows) + f"#{turn}").encode()) & 0x7FFFFFFF
        tokens_bn, n_gen_b, eos_stop_b = generate_fn(padded, seed)
        for r, i in enumerate(rows):
            ids = [int(t) for t in tokens_bn[r, : int(n_gen_b[r])]]
            if eos_stop_b[r] and ids and ids[-1] in eos:
                ids = ids[:-1]  # the chat template adds the end-of-turn token back
            out_msgs[i] = out_msgs[i] + [{"role": "assistant", "content": tokenizer.decode(ids)}]
            n_answers[i] += 1
    return [
        {"id": c["id"], "conversations": msgs} if n else None
        for c, msgs, n in zip(convs, out_msgs, n_answers)
    ]


def make_generate_fn(params, cfg, *, max_new_tokens: int, temperature: float, top_p: float, eos_ids,
                     min_bucket: int = 16):
    """``generate_fn`` for ``regenerate_batch`` backed by the jitted AR loop (one program per
    power-of-two prompt bucket >= ``min_bucket``)."""
    from confu_jax.decode.generate import generate_ar
    from confu_jax.decode.stopping import StopReason

    def generate_fn(prompts, seed):
        res = generate_ar(
            params, cfg, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
            top_p=top_p, seed=seed, eos_ids=tuple(eos_ids), min_bucket=min_bucket,
        )
        reason_b = np.asarray(res.stop_reason_b)
        return np.asarray(res.tokens_bn), np.asarray(res.n_generated_b), reason_b == StopReason.EOS

    return generate_fn


def generate_dataset(
    conversations: Sequence[dict],
    output: str,
    tokenizer,
    generate_fn,
    *,
    batch_size: int,
    max_prompt_len: int,
    progress: bool = True,
) -> dict:
    """Regenerate what ``output`` lacks, batch by batch; returns counts for the run."""
    from tqdm import tqdm

    done = read_done_ids(output)
    seen: set[str] = set()
    todo, n_dup = [], 0
    for c in conversations:
        if c["id"] in seen:
            n_dup += 1
            continue
        seen.add(c["id"])
        if c["id"] not in done:
            todo.append(c)
    if n_dup:
        log.warning("skipped %d conversations whose id repeats an earlier one", n_dup)
    stats = {"already_done": len(seen) - len(todo), "written": 0, "no_answer": 0, "duplicates": n_dup}
    bar = tqdm(total=len(seen), initial=stats["already_done"], unit="conv", disable=not progress,
               desc="regenerating")
    for start in range(0, len(todo), batch_size):
        batch = todo[start : start + batch_size]
        records = regenerate_batch(batch, tokenizer, generate_fn, batch_size=batch_size,
                                   max_prompt_len=max_prompt_len)
        kept = [r for r in records if r is not None]
        stats["written"] += append_records(output, kept)
        stats["no_answer"] += len(records) - len(kept)
        bar.update(len(batch))
    bar.close()
    return stats


# ----------------------------------------------------------------------------------------------
# CLI


def _define_flags():
    from absl import flags

    flags.DEFINE_string("model", "smollm2-135m-instruct", "target: asset name, .gguf or HF directory")
    flags.DEFINE_string("tokenizer", "", "tokenizer source (default: --model)")
    flags.DEFINE_list("input", ["sharegpt"], "conversation files or asset names (ShareGPT/SpecForge/UltraChat)")
    flags.DEFINE_string("output", None, "JSONL to write (appended to; rerun to resume)", required=True)
    flags.DEFINE_integer("max_records", 0, "use only the first N good input conversations (0 = all)")
    flags.DEFINE_integer("batch_size", 16, "conversations per jitted generation call")
    flags.DEFINE_integer("max_new_tokens", 512, "tokens generated per assistant turn at most")
    flags.DEFINE_integer("max_prompt_len", 1536, "longest prompt (tokens) a turn may be generated from")
    flags.DEFINE_float("temperature", 0.0, "0 = greedy")
    flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass (temperature > 0)")
    flags.DEFINE_string("dtype", "", "parameter/compute dtype (default: the checkpoint's)")
    flags.DEFINE_enum("on_bad_record", "skip", ["skip", "fail"], "what to do with malformed input records")
    return flags.FLAGS


def main(argv):
    del argv
    from confu_jax.data.chat import ChatTokenizer
    from confu_jax.data.formats import load_conversations
    from confu_jax.weights import load_model

    f = FLAGS
    convs, report = load_conversations(
        f.input, on_bad_record=f.on_bad_record, max_records=f.max_records or None
    )
    log.info("input: %s", report.summary())
    tokenizer = ChatTokenizer.load(f.tokenizer or f.model)
    cfg, params = load_model(f.model, f.dtype or None)
    generate_fn = make_generate_fn(
        params, cfg, max_new_tokens=f.max_new_tokens, temperature=f.temperature, top_p=f.top_p,
        eos_ids=tokenizer.eos_ids,
    )
    out_dir = os.path.dirname(os.path.abspath(f.output))
    os.makedirs(out_dir, exist_ok=True)
    stats = generate_dataset(convs, f.output, tokenizer, generate_fn, batch_size=f.batch_size,
                             max_prompt_len=f.max_prompt_len)
    print(json.dumps({"output": f.output, **stats}))


if __name__ == "__main__":
    from absl import app

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    FLAGS = _define_flags()
    app.run(main)
