"""Self-distillation: regenerate every assistant turn with the target, write SpecForge JSONL.

    python -m launch.generate_data --output data/regen.jsonl \
        [--model smollm2-135m-instruct] [--input sharegpt,more.jsonl] [--max_records 1000] \
        [--batch_size 16] [--max_new_tokens 512] [--max_turns 0] [--temperature 0] [--top_p 1]
        [--reuse_prefix] [--fill_rows 1] [--steps_per_sync 16]
        [--release releases/data/<name>]

Why: a draft head is trained to imitate the *target's* next-token distribution, so training on the
target's own answers (instead of ShareGPT's ChatGPT answers) removes a distribution shift; EAGLE
recommends it. System and user turns are kept verbatim; assistant turns are regenerated in order,
each one conditioned on the *regenerated* earlier answers (the context the target produces at
inference). User turns after the last assistant turn are dropped (nothing to learn from them).

Generation is batched and jitted. The default engine is **continuous batching**
(``confu_jax.decode.continuous``): ``--batch_size`` slots decode together and a slot whose answer
finished is refilled at once with the next prompt — the next turn of the same conversation
(conditioned on the regenerated answer) or a new conversation — without recompiling; a progress
bar shows conversations and generated tokens/s. A conversation's next turn stays in its slot and
prefills only the tokens the turn adds to the cached context (``--reuse_prefix``, default on;
greedy tokens equal a from-scratch prefill up to float rounding at near-ties), and slots freed
together are prefilled together (``--fill_rows``). ``--engine static`` runs batches of
``--batch_size`` conversations turn by turn through ``generate_ar`` instead.

**A node or a pod** (``confu_jax.data.distill_shards``): run the same command once per process (host);
each takes the conversations whose id hashes to its slot — ``--shard_index`` / ``--num_shards``, else
the launcher's environment (``JAX_PROCESS_ID`` / ``JAX_NUM_PROCESSES``, SLURM's ``SLURM_PROCID`` /
``SLURM_NTASKS``, a Cloud TPU VM pod's worker id) — appends to its own
``<output>.shard-IIIII-of-NNNNN`` file (resumable like any output) and marks it done; process 0 then
waits for every shard and merges them into ``--output`` in input order (``--nomerge``: leave that to a
later run). ``--shard_target`` splits the target's weights over this process's devices (a tensor
axis), for a target that does not fit one device; the processes never communicate.

Output ``{"id", "conversations": [{"role", "content"}]}`` per line, append-only, flushed and fsynced
after every conversation (continuous) or batch (static), so a killed run loses at most the
conversations in flight. Rerunning with the same
``--output`` resumes: ids already in the file are skipped, and a torn last line (killed mid-write)
is cut off first. Input ids must be unique (duplicates after the first are skipped, with a count).
A conversation whose prompt would exceed ``--max_prompt_len`` tokens stops at the answers it has, as
does one whose answer comes back empty (the target ended its turn at once: nothing to learn, and
not a usable record); one with no regenerated answer at all is not written (and is re-checked,
cheaply, on resume).

Every invocation appends its command line to ``<output>.runs.jsonl`` (``launch.release_data``
records it in the release manifest). ``--release releases/data/<name>`` skips the conversations
that data release already holds (its parts are hash-checked first), so nothing released is ever
generated twice; pack the output into it with ``launch.release_data``.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import sys
import zlib
from typing import Callable, Iterable, Sequence

import numpy as np

from confu_jax.data.distill_shards import (merge_shards, mark_done, process_slot, shard_of, shard_output,
                                           wait_for_shards)

log = logging.getLogger("generate_data")


# ----------------------------------------------------------------------------------------------
# Output file: resume bookkeeping


def scan_output(path: str) -> tuple[list[dict], int, int]:
    """``(records, end, size)`` of a generate_data output: every complete record in order, the byte
    offset just past the last one, and the file's size (``end < size``: a torn last line).

    Only the last line can be torn (append-only writes); a bad line elsewhere means the file is not
    ours, and resuming into (or releasing) it would be unsafe, so that raises. Reads only: a file
    another run is still appending to can be scanned.
    """
    if not os.path.exists(path):
        return [], 0, 0
    records: list[dict] = []
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
        records.append(rec)
        good_end = nl + 1
        pos = nl + 1
    return records, good_end, len(data)


def read_records(path: str) -> list[dict]:
    """The complete records of ``path`` (a torn last line is ignored, the file left as it is)."""
    records, end, size = scan_output(path)
    if end < size:
        log.info("%s: ignoring a torn (or still being written) last line of %d bytes", path, size - end)
    return records


def read_done_ids(path: str) -> set[str]:
    """Ids already written to ``path``; a torn last line (no newline / invalid JSON) is cut off."""
    records, good_end, size = scan_output(path)
    if good_end < size:
        log.warning("%s: cutting a torn last line (%d bytes) before resuming", path, size - good_end)
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return {str(rec["id"]) for rec in records}


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
    before: list[list[dict]] = [[] for _ in convs]  # each conversation's messages before this turn
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
            before[i], out_msgs[i] = out_msgs[i], context
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
            text = tokenizer.decode(ids)
            if not text.strip():  # the target ended its turn at once: no example; stop before this turn
                out_msgs[i], alive[i] = before[i], False
                continue
            out_msgs[i] = out_msgs[i] + [{"role": "assistant", "content": text}]
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


def keep_turns(conv: dict, max_turns: int) -> dict:
    """``conv`` cut after its ``max_turns``-th assistant turn (0: unchanged).

    Why: a training row holds ``data.max_length`` tokens, so answers to later turns (whose prompts
    already hold the earlier answers) often lie past the row's end; regenerating them costs decode
    time and trains nothing.
    """
    if max_turns <= 0:
        return conv
    seen = 0
    for i, m in enumerate(conv["messages"]):
        if m["role"] == "assistant":
            seen += 1
            if seen == max_turns:
                return {**conv, "messages": list(conv["messages"][: i + 1])}
    return conv


def first_questions(conversations, tokenizer, max_prompt_len: int, n: int) -> list[dict]:
    """The first ``n`` conversations cut to their first question (the turns before the first
    assistant answer, which the target regenerates) whose chat-template prompt fits ``max_prompt_len``."""
    out = []
    for c in conversations:
        msgs = keep_turns(c, 1)["messages"]
        if not msgs or msgs[-1]["role"] != "assistant":
            continue
        ids, _ = tokenizer.encode_chat(msgs[:-1], add_generation_prompt=True)
        if len(ids) <= max_prompt_len:
            out.append({"id": c["id"], "messages": msgs})
            if len(out) == n:
                break
    return out


def pending_conversations(conversations: Sequence[dict], output: str):
    """What ``output`` still lacks -> (conversations to do, in input order; run counts). Ids
    already written are skipped (resume); a repeated id is skipped after its first occurrence."""
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
    return todo, {"already_done": len(seen) - len(todo), "written": 0, "no_answer": 0, "duplicates": n_dup}


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
    from confu_jax import progress as progress_lib

    todo, stats = pending_conversations(conversations, output)
    bar = progress_lib.bar(stats["already_done"] + len(todo), initial=stats["already_done"], unit="conv",
                           enabled=progress, desc="regenerating")
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
# Continuous batching (the default engine)


class _Conversation:
    """Turn-by-turn regeneration state of one conversation."""

    def __init__(self, conv: dict):
        self.id = conv["id"]
        self.slots = _assistant_slots(conv["messages"])
        self.messages: list[dict] = []
        self.before: list[dict] = []  # the messages before the turn being answered
        self.turn = 0
        self.n_answers = 0

    def next_prompt(self, tokenizer, max_prompt_len: int):
        """Ids of the next turn's prompt, or None when the conversation is complete (no turn left,
        or the next prompt would exceed ``max_prompt_len``: it stops at the answers it has)."""
        if self.turn >= len(self.slots):
            return None
        context = self.messages + self.slots[self.turn]
        ids, _ = tokenizer.encode_chat(context, add_generation_prompt=True)
        if len(ids) > max_prompt_len:
            return None
        self.before, self.messages = self.messages, context
        return ids

    def add_answer(self, ids: list, stopped_at_eos: bool, tokenizer) -> None:
        if stopped_at_eos and ids and ids[-1] in set(int(e) for e in tokenizer.eos_ids):
            ids = ids[:-1]  # the chat template adds the end-of-turn token back
        text = tokenizer.decode(ids)
        if not text.strip():  # the target ended its turn at once: no example; stop before this turn
            self.messages, self.turn = self.before, len(self.slots)
            return
        self.messages = self.messages + [{"role": "assistant", "content": text}]
        self.turn += 1
        self.n_answers += 1

    def record(self):
        return {"id": self.id, "conversations": self.messages} if self.n_answers else None


def turn_seed(conv_id: str, turn: int) -> int:
    """The sampling seed of one turn: a function of the conversation and the turn only, so a
    resumed or re-sharded run samples the same answers."""
    return zlib.crc32(f"{conv_id}#{turn}".encode()) & 0x7FFFFFFF


def generate_dataset_continuous(conversations: Sequence[dict], output: str, tokenizer, engine, *,
                                max_prompt_len: int, progress: bool = True) -> dict:
    """Regenerate what ``output`` lacks with a continuous-batching ``engine``
    (``confu_jax.decode.continuous.ContinuousGenerator`` or anything with its ``run``).

    Turns of different conversations share the batch: when a turn finishes, the conversation's
    next turn (conditioned on the regenerated answer) is queued, and a conversation is appended to
    ``output`` (and fsynced) once it and every conversation started before it are done, so the
    file keeps the input order whatever the timing (at most 16x the batch of conversations are in
    flight or waiting for an earlier one). A kill loses only those; rerunning resumes as ``generate_dataset`` does.

    Every request names its conversation as its ``session``: an engine with prefix reuse
    (``ContinuousGenerator(reuse_prefix=True)``) keeps a conversation in its slot and prefills only
    the tokens a turn adds to the context it already holds (the previous answer's end of turn, the
    next user turn and the generation prompt), not the whole context again. The follow-up is
    queued as soon as the answer is read, so it is in the engine's next ``more()`` poll.
    """
    import time

    from confu_jax import progress as progress_lib

    from confu_jax.decode.stopping import StopReason

    todo, stats = pending_conversations(conversations, output)
    bar = progress_lib.bar(stats["already_done"] + len(todo), initial=stats["already_done"], unit="conv",
                           enabled=progress, desc="regenerating")
    pending = iter(todo)
    active: dict[str, _Conversation] = {}
    follow_ups: list[tuple] = []
    width = getattr(engine, "batch", 1)
    t0, tok0 = time.perf_counter(), getattr(engine, "tokens_generated", 0)

    last_log = [t0]  # a log line a minute when no bar is shown
    started: collections.deque = collections.deque()  # ids in input order, written in that order
    complete: set[str] = set()

    def finish(conv: _Conversation):
        complete.add(conv.id)
        ready = []
        while started and started[0] in complete:
            done_conv = active.pop(started.popleft())
            complete.discard(done_conv.id)
            rec = done_conv.record()
            if rec is None:
                stats["no_answer"] += 1
            else:
                ready.append(rec)
            bar.update(1)
        if ready:
            stats["written"] += append_records(output, ready)

    def more():
        """Next turns of running conversations, then new conversations while fewer than 2x the
        batch are running (so a freed slot always finds work) and the reorder buffer is bounded."""
        out, follow_ups[:] = list(follow_ups), []
        while len(active) - len(complete) < 2 * width and len(active) < 16 * width:
            c = next(pending, None)
            if c is None:
                break
            conv = active[c["id"]] = _Conversation(c)
            started.append(conv.id)
            ids = conv.next_prompt(tokenizer, max_prompt_len)
            if ids is None:
                finish(conv)
                continue
            out.append((conv.id, ids, turn_seed(conv.id, conv.turn), conv.id))
        return out

    for fin in engine.run([], more=more):
        conv = active[fin.request_id]
        conv.add_answer(fin.tokens, fin.reason == StopReason.EOS, tokenizer)
        ids = conv.next_prompt(tokenizer, max_prompt_len)
        if ids is None:
            finish(conv)
        else:
            follow_ups.append((conv.id, ids, turn_seed(conv.id, conv.turn), conv.id))  # same session: same slot
        dt = time.perf_counter() - t0
        if dt > 0:
            tok_s = (getattr(engine, 'tokens_generated', 0) - tok0) / dt
            bar.set_postfix(tok_s=f"{tok_s:.1f}", refresh=False)
            if bar.disable and progress and time.perf_counter() - last_log[0] > 60:  # no bar (not a terminal)
                last_log[0] = time.perf_counter()
                # a disabled tqdm bar counts nothing (bar.n stays 0): count from the run's stats
                done = stats["already_done"] + stats["written"] + stats["no_answer"]
                log.info("regenerating: %d/%d conversations done, %.1f tokens/s", done, bar.total, tok_s)
    bar.close()
    return stats


def regenerate_continuous(conversations: Sequence[dict], output: str, tokenizer, cfg, params, *,
                          batch_size: int, max_new_tokens: int, max_prompt_len: int,
                          temperature: float = 0.0, top_p: float = 1.0, steps_per_sync: int = 16,
                          reuse_prefix: bool = True, fill_rows: int = 1, progress: bool = True) -> dict:
    """Build the continuous-batching engine for ``params`` and regenerate what ``output`` lacks.

    The CLI's default path, and what ``launch.quickstart`` calls to self-distil its training data.
    ``reuse_prefix``: a conversation's next turn continues in its slot, prefilling only the new
    tokens (``confu_jax.decode.continuous``); ``fill_rows``: rows prefilled together at most.
    Returns the run's counts plus ``tokens_generated`` and ``seconds`` (compilation included).
    """
    import time

    from confu_jax.decode.continuous import ContinuousGenerator

    t0 = time.perf_counter()
    engine = ContinuousGenerator(params, cfg, batch=batch_size, max_len=max_prompt_len + max_new_tokens,
                                 max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                 eos_ids=tokenizer.eos_ids, steps_per_sync=steps_per_sync,
                                 reuse_prefix=reuse_prefix, max_fill_rows=fill_rows)
    stats = generate_dataset_continuous(conversations, output, tokenizer, engine,
                                        max_prompt_len=max_prompt_len, progress=progress)
    stats["tokens_generated"] = engine.tokens_generated
    stats["seconds"] = round(time.perf_counter() - t0, 1)
    return stats


# ----------------------------------------------------------------------------------------------
# CLI


def _define_flags(flag_values=None):
    """The CLI's flags, defined on ``flag_values`` (default: absl's global FLAGS)."""
    import functools

    from absl import flags as absl_flags

    fv = flag_values if flag_values is not None else absl_flags.FLAGS

    class _Bound:  # absl's DEFINE_* bound to ``fv`` (parse_generation_command defines them on its own)
        FLAGS = fv

        def __getattr__(self, name):
            return functools.partial(getattr(absl_flags, name), flag_values=fv)

    flags = _Bound()

    flags.DEFINE_string("model", "smollm2-135m-instruct", "target: asset name, .gguf or HF directory")
    flags.DEFINE_string("tokenizer", "", "tokenizer source (default: --model)")
    flags.DEFINE_list("input", ["sharegpt"], "conversation files or asset names (ShareGPT/SpecForge/UltraChat)")
    flags.DEFINE_string("output", None, "JSONL to write (appended to; rerun to resume)", required=True)
    flags.DEFINE_integer("max_records", 0, "use only the first N good input conversations (0 = all)")
    flags.DEFINE_integer("max_turns", 0, "regenerate at most this many assistant turns per conversation (0 = "
                         "all); later turns are dropped. 1 suits training rows too short to reach later turns")
    flags.DEFINE_enum("engine", "continuous", ["continuous", "static"],
                      "continuous: B slots refilled as rows finish (confu_jax.decode.continuous); "
                      "static: batches of --batch_size conversations, turn by turn (generate_ar)")
    flags.DEFINE_integer("batch_size", 32, "rows decoded together (continuous: slots; static: conversations per call)")
    flags.DEFINE_integer("steps_per_sync", 16, "continuous: decode steps between host checks for finished rows")
    flags.DEFINE_bool("reuse_prefix", True, "continuous: a conversation's next turn continues in its slot and "
                      "prefills only the tokens the turn adds (off: every turn prefills its whole context)")
    flags.DEFINE_integer("fill_rows", 1, "continuous: slots refilled at one sync are prefilled together, this "
                         "many at most per call")
    flags.DEFINE_integer("max_new_tokens", 512, "tokens generated per assistant turn at most")
    flags.DEFINE_integer("max_prompt_len", 512,
                         "longest prompt (tokens) a turn may be generated from; the continuous engine's "
                         "cache holds max_prompt_len + max_new_tokens slots per row")
    flags.DEFINE_float("temperature", 0.0, "0 = greedy")
    flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass (temperature > 0)")
    flags.DEFINE_string("dtype", "", "parameter/compute dtype (default: the checkpoint's)")
    flags.DEFINE_enum("on_bad_record", "skip", ["skip", "fail"], "what to do with malformed input records")
    flags.DEFINE_integer("num_shards", None, "split the conversations over this many processes/hosts (by id "
                         "hash); default: the launcher's environment (JAX_NUM_PROCESSES, SLURM_NTASKS, TPU "
                         "pod workers), else 1")
    flags.DEFINE_integer("shard_index", None, "which shard this process generates (default: the launcher's "
                         "environment); its output gets a '.shard-IIIII-of-NNNNN' suffix when num_shards > 1")
    flags.DEFINE_bool("merge", True, "with several shards: process 0 waits for every shard, then merges them "
                      "into --output in input order")
    flags.DEFINE_bool("shard_target", False, "split the target's weights over this process's devices (a tensor "
                      "axis) instead of placing them on one device")
    flags.DEFINE_integer("cpu_devices", 0, "expose N CPU devices in this process (tests of --shard_target on a "
                         "CPU machine); 0 = JAX's default")
    flags.DEFINE_list("release", [], "data release folders (releases/data/<name>, confu_jax.data.releases), "
                      "comma-separated: conversations any of them holds are not generated again")
    return flags.FLAGS


# ----------------------------------------------------------------------------------------------
# What made an output: the command of every run, for launch.release_data's manifest

RUNS_SUFFIX = ".runs.jsonl"  # beside the output: one {"command", "started"} line per invocation


def record_run(output: str, argv: Sequence[str]) -> str:
    """Append this invocation's command line to ``<output>.runs.jsonl``; returns the command."""
    import datetime
    import shlex

    command = "python -m launch.generate_data " + shlex.join(list(argv[1:]))
    started = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()
    append_records(output + RUNS_SUFFIX, [{"command": command, "started": started}])
    return command


def parse_generation_command(command: str) -> dict:
    """The generation settings of a ``launch.generate_data`` command line (defaults filled in):
    ``command`` plus model, tokenizer, dtype, input, max_records, max_turns, temperature, top_p,
    max_new_tokens, max_prompt_len, engine, batch_size."""
    import shlex

    from absl import flags as absl_flags

    words = shlex.split(command)
    at = next((i for i, w in enumerate(words) if w in ("launch.generate_data", "launch/generate_data.py")
               or w.endswith("/launch/generate_data.py")), None)
    if at is None:
        raise ValueError(f"not a launch.generate_data command line: {command!r}")
    fv = absl_flags.FlagValues()
    _define_flags(fv)
    try:
        fv(["generate_data"] + words[at + 1 :])
    except absl_flags.Error as e:
        raise ValueError(f"cannot parse the generate_data command {command!r}: {e}") from e
    keys = ("model", "tokenizer", "dtype", "input", "max_records", "max_turns", "temperature", "top_p",
            "max_new_tokens", "max_prompt_len", "engine", "batch_size")
    settings = {"command": command, **{k: fv[k].value for k in keys}}
    settings["tokenizer"] = settings["tokenizer"] or settings["model"]
    settings["input"] = list(settings["input"])
    return settings


def drop_released(conversations: Sequence[dict], release: str) -> tuple[list[dict], int]:
    """``conversations`` less those whose ids the data release ``release`` holds (its parts are
    hash-checked first), and how many were dropped."""
    from confu_jax.data.releases import released_ids

    done = released_ids(release)
    kept = [c for c in conversations if c["id"] not in done]
    return kept, len(conversations) - len(kept)


def main(argv):
    del argv
    from confu_jax.compile_cache import enable_compilation_cache
    from confu_jax.data.chat import ChatTokenizer
    from confu_jax.data.formats import load_conversations

    f = FLAGS
    if f.cpu_devices:
        from confu_jax.train.distributed import configure_cpu

        configure_cpu(f.cpu_devices, None)
    enable_compilation_cache()  # compiled programs persist across runs (CONFU_JAX_COMPILE_CACHE)
    try:
        shard_index, num_shards = process_slot(f.shard_index, f.num_shards)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    convs, report = load_conversations(
        f.input, on_bad_record=f.on_bad_record, max_records=f.max_records or None
    )
    log.info("input: %s", report.summary())
    every = [keep_turns(c, f.max_turns) for c in convs]  # all shards' conversations (process 0 merges them)
    n_released = 0
    for release in f.release:
        every, n_dropped = drop_released(every, release)
        n_released += n_dropped
        log.info("%s: %d conversations already released, not generated again", release, n_dropped)
    assignment = [[] for _ in range(num_shards)]
    for c in every:
        assignment[shard_of(c["id"], num_shards)].append(c["id"])
    convs = [c for c in every if shard_of(c["id"], num_shards) == shard_index]
    output = shard_output(f.output, shard_index, num_shards)
    log.info("shard %d of %d: %d conversations -> %s", shard_index, num_shards, len(convs), output)
    tokenizer = ChatTokenizer.load(f.tokenizer or f.model)
    cfg, params = _load_target(f.model, f.dtype or None, f.shard_target)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    record_run(output, sys.argv)
    if f.engine == "continuous":
        stats = regenerate_continuous(convs, output, tokenizer, cfg, params, batch_size=f.batch_size,
                                      max_new_tokens=f.max_new_tokens, max_prompt_len=f.max_prompt_len,
                                      temperature=f.temperature, top_p=f.top_p, steps_per_sync=f.steps_per_sync,
                                      reuse_prefix=f.reuse_prefix, fill_rows=f.fill_rows)
    else:
        generate_fn = make_generate_fn(params, cfg, max_new_tokens=f.max_new_tokens, temperature=f.temperature,
                                       top_p=f.top_p, eos_ids=tokenizer.eos_ids)
        stats = generate_dataset(convs, output, tokenizer, generate_fn, batch_size=f.batch_size,
                                 max_prompt_len=f.max_prompt_len)
    summary = {"output": output, **stats, **({"already_released": n_released} if f.release else {})}
    if num_shards > 1:
        mark_done(output, assignment[shard_index], stats)
        if shard_index == 0 and f.merge:
            wait_for_shards(f.output, assignment)
            summary["merged"] = merge_shards(f.output, num_shards, [c["id"] for c in every], read_records)
            summary["merged"]["output"] = f.output
            record_run(f.output, sys.argv)  # the merged file's provenance, for launch.release_data
    print(json.dumps(summary))


def _load_target(model: str, dtype, shard: bool):
    """(LlamaConfig, params): on one device, or with ``shard`` split over this process's devices along a
    tensor axis (the training layout's rules; a Hugging Face checkpoint is read slice by slice)."""
    from confu_jax.weights import load_model, load_model_sharded, read_architecture

    if not shard:
        return load_model(model, dtype)
    import jax

    from confu_jax import sharding as shd
    from confu_jax.models.llama import param_shapes

    cfg = read_architecture(model, dtype)
    mesh = shd.make_mesh(1, 1, jax.local_device_count(), devices=jax.local_devices())
    shardings = shd.tree_shardings(param_shapes(cfg), mesh, shd.PARAM_RULES, axis_units=shd.llama_axis_units(cfg.head_dim))
    return load_model_sharded(model, shardings, dtype)


if __name__ == "__main__":
    from absl import app

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    FLAGS = _define_flags()
    app.run(main)
