"""Trainer parity: one EAGLE-3 head trained by speculators 0.9's own trainer and one by ours, on the same
rows, draft vocabulary, row budget, steps, learning-rate schedule and TTT length (docs/RESULTS.md
"Trainer parity"; the driver is ``experiments/trainer_parity.sh``).

    python -m experiments.trainer_parity prepare   --out runs/parity --target asset:smollm2-135m-instruct \\
        --data releases/data/sharegpt_smollm2
    python -m experiments.trainer_parity hidden    --out runs/parity        # the reference's hidden states
    python -m experiments.trainer_parity train_ref --out runs/parity --steps 120
    python -m experiments.trainer_parity train_ours --out runs/parity --steps 120
    python -m experiments.trainer_parity settings  --out runs/parity        # what is equal, what differs

**One set of rows for both.** ``prepare`` reads the conversations and renders them with *our* data path
(``train.real_data``: the target's chat template, ``encode_example`` truncation, the last ``eval_records``
conversations held out, the draft vocabulary counted on the rest), then hands those very rows to
speculators as pre-tokenised ``{input_ids, loss_mask}`` records through its own ``prepare-data`` (its
pass-through path: no render server) — training rows first, held-out rows after, and
``train_data_ratio`` set so speculators' index split falls exactly between them. The draft vocabulary is
one file: our ``.npz`` for ours, its ``d2t`` offsets / ``t2d`` mask as ``.npy`` for speculators.

**The reference's hidden states** come from transformers (the target's reference implementation here) on
the target's Hugging Face directory: speculators' own generator is a client of a vLLM server with its
hidden-states connector; the file it reads is ``<data>/hidden_states/hs_<i>.safetensors`` with
``hidden_states`` [T, 4, d] (the states entering layers 2, L//2, L-3, then the last layer's output *before*
the final norm, which the trainer applies itself) and ``token_ids`` [T]. Kept in float32 (ours trains in
float32). ``hidden`` is resumable: it skips the files already written.

**Training.** ``train_ref`` writes the reference's YAML and runs ``experiments/speculators_cpu.py`` (the CPU
patches it lists; no edit of the package); ``train_ours`` runs ``launch.train`` with ``configs/eagle3.py``.
Both resume where they stopped. Everything the issue fixes is set equal (``EQUAL``); everything else
stays at each trainer's default and is listed (``DIFFERENT``): those differences are what the parity runs
measure, and what an ablation takes one at a time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys

import numpy as np

from experiments.speculators_cpu import PATCHES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
log = logging.getLogger("trainer_parity")

# What the issue fixes equal (the values of the parity runs; prepare records them in prepare.json).
EQUAL = {
    "rows": "the same conversations rendered by our chat-template path (prepare.json: conversations, tokens)",
    "held_out": "the last 64 conversations (ours: objective.eval_records; speculators: its validation split)",
    "max_length": 1024,  # tokens a conversation keeps (both truncate the same rows: they are ours)
    "tokens_per_step": 8192,  # ours: 8 packed rows of 1024; speculators: one packed sequence of 8192
    "draft_vocab_size": 4096,  # one file: draft_vocab.npz == d2t.npy / t2d.npy
    "ttt_steps": 3,  # speculators' default; chain:3 decodes three draft steps
    "lr": 1e-3,  # both trainers' default peak for EAGLE-3 (ours: experiments/families_compare.sh)
    "schedule": "linear warm-up over 1 % of the steps, then linear to 0 (speculators' 'linear'; ours "
                "'wsd' with decay_ratio 1)",
    "seed": 0,
    "precision": "float32 weights, hidden states and compute (no autocast: hidden_states_dtype float32)",
}
DIFFERENT = {
    "optimizer": ("AdamW b1 0.9 b2 0.95 eps 1e-8, no weight decay", "Muon on 2-D weights (momentum 0.95, 5 "
                  "Newton-Schulz steps, lr matched to AdamW's RMS, weight decay 0.1) + AdamW on the rest (weight "
                  "decay 0.01)"),
    "gradient clipping": ("global norm 0.5", "global norm 1.0"),
    "TTT step weights": ("0.8^s (EAGLE-3's)", "1 for every step"),
    "loss": ("KL(teacher || draft) over the draft vocabulary", "KL(teacher || draft) over the draft vocabulary "
             "(kl_div)"),
    "positions a step trains": ("the token predicted is an answer token", "the token fed in is an answer token "
                                "(loss_mask of x_{t+1} gates the prediction of x_{t+2})"),
    "draft LM head": ("trained, random init (std 0.02)", "frozen: the target's LM head rows of the draft vocabulary"),
    "fused-state norms": ("none (EAGLE-3's official layout)", "RMSNorm over the 3 taps before fc, the hidden "
                          "normed before the residual, the output normed (norm_before_fc, norm_before_residual, "
                          "norm_output)"),
    "packing": ("first-fit into 8 rows of 1024 (64 bins in flight)", "multipack into one sequence of 8192"),
    "draft attention": ("full causal within a conversation", "sliding window 2048 within a conversation "
                        "(rows are <= 1024: the same)"),
}

TRAIN_ROWS, EVAL_ROWS = "rows_train.jsonl", "rows_heldout.jsonl"


# ----------------------------------------------------------------------------------------------- ours

# Our run with one thing changed, in <out>/ours_<name>, everything else equal (rows, steps, schedule): each
# difference from the reference taken alone (its value), and the objectives that target acceptance.
VARIANTS = {
    "muon": ["--config.train.optim.name=muon", "--config.train.optim.b2=0.999",
             "--config.train.optim.weight_decay=0.01"],  # its optimizer pair, its AdamW group's settings
    "clip1": ["--config.train.optim.clip_norm=1.0"],
    "decay1": ["--config.draft.ttt_decay=1.0"],
    "norms": ["--config.draft.norm_before_fc=True", "--config.draft.norm_before_residual=True",
              "--config.draft.norm_output=True"],
    "targethead": ["--config.draft.lm_head_init=target"],  # its LM head's start (it then stays frozen there)
    **{loss: [f"--config.objective.step_loss={loss}"] for loss in ("lk", "tv", "nla", "ce", "rkl", "jsd")},
    # packed rows of 2048 (4 a step: the same 8192 slots): ShareGPT's rows fill them to ~96 %, as speculators'
    # multipack fills its 8192, against ~78 % in rows of 1024 (RESULTS "Trainer parity")
    "pack2048": ["--config.data.pack_length=2048"],
}
# the packed row length a variant trains on (the rows a step follow from it: the same token slots)
ROW_LENGTH = {"pack2048": 2048}


def our_flags(out: str, target: str, data: str, steps: int, max_length: int = EQUAL["max_length"],
              draft_vocab: int = EQUAL["draft_vocab_size"], eval_records: int = 64, max_records: int = 0,
              variant: str = "") -> list:
    """``launch.train`` flags of our run (``configs/eagle3.py``): the equal settings, our defaults else;
    ``variant`` (:data:`VARIANTS`): the same run with that change, in ``<out>/ours_<variant>``."""
    if variant and variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: expected one of {sorted(VARIANTS)}")
    rows = EQUAL["tokens_per_step"] // ROW_LENGTH.get(variant, max_length)
    return [
        "--config", os.path.join(ROOT, "configs", "eagle3.py"), "--workdir",
        os.path.join(out, f"ours_{variant}" if variant else "ours"),
        f"--config.model.source={target}", f"--config.data.train_files={data}",
        f"--config.data.max_records={max_records}",
        f"--config.data.max_length={max_length}", f"--config.data.global_batch_size={rows}",
        "--config.data.pack=True", "--config.data.pack_bins=64", "--config.data.num_workers=0",
        f"--config.draft.draft_vocab_size={draft_vocab}", f"--config.data.draft_vocab_size={draft_vocab}",
        f"--config.data.draft_vocab_path={os.path.join(out, 'draft_vocab.npz')}",
        f"--config.draft.ttt_steps={EQUAL['ttt_steps']}", f"--config.objective.eval_records={eval_records}",
        f"--config.train.steps={steps}", f"--config.train.seed={EQUAL['seed']}",
        f"--config.train.optim.lr={EQUAL['lr']}", "--config.train.optim.schedule=wsd",
        "--config.train.optim.decay_ratio=1.0", "--config.train.optim.warmup_steps=-1",
        "--config.train.optim.warmup_ratio=0.01", "--config.train.optim.end_lr_ratio=0.0",
        f"--config.train.checkpoint.every={max(1, min(10, steps))}", "--config.train.checkpoint.keep=2",
        f"--config.train.eval_every={max(1, steps // 4)}", "--config.train.log_every=1",
        "--config.train.progress_bar=False", "--config.train.tensorboard=off",
    ] + VARIANTS.get(variant, [])


def our_config(target: str, data: str, max_length: int, draft_vocab: int, eval_records: int, max_records: int = 0):
    """The config ``launch.train`` builds from :func:`our_flags` (what ``prepare`` renders rows with)."""
    from configs.eagle3 import get_config

    config = get_config()
    config.model.source = target
    config.data.train_files = data
    config.data.max_records = max_records
    config.data.max_length = max_length
    config.draft.draft_vocab_size = draft_vocab
    config.objective.eval_records = eval_records
    return config


# ---------------------------------------------------------------------------------------------- prepare

def hf_target_dir(out: str, target: str) -> str:
    """The target as a Hugging Face directory (speculators' verifier; transformers' hidden states): the
    checkpoint itself when it is one, else our export of it (weights as we load them, our tokenizer)."""
    if os.path.isfile(os.path.join(target, "config.json")):
        return os.path.abspath(target)
    directory = os.path.abspath(os.path.join(out, "target"))
    if not os.path.isfile(os.path.join(directory, "model.safetensors")):
        from confu_jax.assets import strip_asset
        from confu_jax.data.chat import ChatTokenizer
        from confu_jax.weights import load_model, save_hf

        cfg, params = load_model(strip_asset(target), dtype="float32")
        save_hf(cfg, params, directory)
        ChatTokenizer.load(strip_asset(target)).save(directory)
    return directory


def prepare(out: str, target: str, data: str, max_length: int, draft_vocab: int, eval_records: int,
            max_records: int = 0) -> dict:
    out = os.path.abspath(out)
    from confu_jax.data import formats, pipeline
    from confu_jax.data.draft_vocab import draft_vocab_for_training
    from confu_jax.train.real_data import training_tokenizer

    os.makedirs(out, exist_ok=True)
    config = our_config(target, data, max_length, draft_vocab, eval_records, max_records)
    tokenizer = training_tokenizer(config)
    conversations, report = formats.load_conversations(pipeline.train_files(config.data), on_bad_record="skip",
                                                  max_records=max_records or None)
    train_convs, eval_convs = formats.split_held_out(conversations, eval_records)
    verifier = hf_target_dir(out, target)
    with open(os.path.join(verifier, "config.json")) as f:
        target_vocab = int(json.load(f)["vocab_size"])
    vocab = draft_vocab_for_training(config.data, tokenizer, target_vocab, conversations=train_convs)
    vocab.save(os.path.join(out, "draft_vocab.npz"))
    np.save(os.path.join(out, "d2t.npy"), vocab.eagle3_offsets())  # speculators: target = draft + d2t[draft]
    np.save(os.path.join(out, "t2d.npy"), vocab.t2d.astype(bool))

    def rows(convs, name):
        n_tok = n_loss = 0
        with open(os.path.join(out, name), "w") as f:
            for c in convs:
                r = pipeline.encode_example(c["messages"], tokenizer, max_length, 1, pad=False)
                if r is None:
                    continue
                f.write(json.dumps({"input_ids": r["tokens"].tolist(), "loss_mask": r["loss_mask"].astype(int).tolist()})
                        + "\n")
                n_tok, n_loss = n_tok + len(r["tokens"]), n_loss + int(r["loss_mask"].sum())
        return n_tok, n_loss

    stats = {"train": rows(train_convs, TRAIN_ROWS), "heldout": rows(eval_convs, EVAL_ROWS)}
    if not stats["train"][0] or not stats["heldout"][0]:
        raise ValueError(f"{data}: no training or no held-out row keeps an answer token at max_length={max_length} "
                         f"(rows of {len(train_convs)} / {len(eval_convs)} conversations): raise --max_length")
    n_train, n_eval = _reference_dataset(out, verifier, max_length)
    info = {"target": target, "verifier_dir": verifier, "data": data, "load_report": report.summary(),
            "conversations": {"train": len(train_convs), "heldout": len(eval_convs)},
            "rows": {"train": n_train, "heldout": n_eval},
            "tokens": {k: v[0] for k, v in stats.items()}, "answer_tokens": {k: v[1] for k, v in stats.items()},
            "train_data_ratio": _split_ratio(n_train, n_eval), "max_length": max_length,
            "draft_vocab_size": draft_vocab, "eval_records": eval_records, "max_records": max_records}
    with open(os.path.join(out, "prepare.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info


def _split_ratio(n_train: int, n_eval: int) -> float:
    """speculators splits at ``int(len * ratio)`` (train/data.py): a ratio that lands on ``n_train``."""
    n = n_train + n_eval
    ratio = (n_train + 0.5) / n
    assert int(n * ratio) == n_train
    return ratio


def _reference_dataset(out: str, verifier: str, max_length: int) -> tuple:
    """Our rows through speculators' ``prepare-data`` (pre-tokenised pass-through), training rows then
    held-out rows in one Arrow dataset at ``<out>/ref_data`` -> (training rows, held-out rows)."""
    from datasets import concatenate_datasets, load_from_disk

    parts = []
    for name in (TRAIN_ROWS, EVAL_ROWS):
        dest = os.path.join(out, "ref_prepare", name.split(".")[0])
        if os.path.isdir(dest):
            shutil.rmtree(dest)
        cmd = [sys.executable, "-m", "speculators", "prepare-data", "--model", verifier,
               "--data", os.path.join(out, name), "--output", dest, "--seq-length", str(max_length),
               "--num-preprocessing-workers", "1", "--minimum-valid-tokens", "1"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"speculators prepare-data failed ({' '.join(cmd)}):\n{r.stderr[-3000:]}")
        parts.append(load_from_disk(dest))
    dataset = concatenate_datasets(parts)
    dataset.set_format("torch")  # as prepare-data saves it (the trainer's reader needs tensors)
    dest = os.path.join(out, "ref_data")
    if os.path.isdir(dest):
        keep = os.path.join(dest, "hidden_states")
        if os.path.isdir(keep):  # rows changed: the stored hidden states no longer match them
            shutil.rmtree(keep)
        shutil.rmtree(dest)
    dataset.save_to_disk(dest)
    return len(parts[0]), len(parts[1])


# ------------------------------------------------------------------------------------------ hidden states

def reference_layers(n_layers: int) -> list:
    """EAGLE-3's taps (the states entering layers 2, L//2, L-3; speculators' default ids) + the last layer."""
    return [2, n_layers // 2, n_layers - 3, n_layers]


def write_hidden_states(out: str, threads: int = 2, limit: int = 0) -> int:
    """``<out>/ref_data/hidden_states/hs_<i>.safetensors`` for every row not yet written -> rows written."""
    import torch
    from datasets import load_from_disk
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    with open(os.path.join(out, "prepare.json")) as f:
        verifier = json.load(f)["verifier_dir"]
    dataset = load_from_disk(os.path.join(out, "ref_data"))
    directory = os.path.join(out, "ref_data", "hidden_states")
    os.makedirs(directory, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(verifier, dtype=torch.float32).eval()
    model.config.tie_last_hidden_states = False  # hidden_states[-1]: the last layer's output, before the norm
    layers = reference_layers(model.config.num_hidden_layers)
    written = 0
    with torch.no_grad():
        for i in range(len(dataset)):
            path = os.path.join(directory, f"hs_{i}.safetensors")
            if os.path.exists(path):
                continue
            ids = dataset[i]["input_ids"].to(torch.long)
            hidden = model(ids[None], output_hidden_states=True).hidden_states
            states = torch.stack([hidden[k][0] for k in layers], dim=1).contiguous()  # [T, 4, d]
            save_file({"hidden_states": states, "token_ids": ids.clone()}, path + ".tmp")
            os.replace(path + ".tmp", path)  # a killed run never leaves a half file under the final name
            written += 1
            if limit and written >= limit:
                break
            if written % 200 == 0:
                log.info("hidden states: %d written (row %d of %d)", written, i + 1, len(dataset))
    return written


# --------------------------------------------------------------------------------------------- reference

def reference_config(out: str, steps: int, checkpoint_every: float = 0.1,
                     tokens_per_step: int = EQUAL["tokens_per_step"]) -> dict:
    """speculators' YAML for the reference run: the equal settings, its defaults else, CPU settings."""
    with open(os.path.join(out, "prepare.json")) as f:
        prep = json.load(f)
    run = os.path.join(out, "reference")
    return {"train": {
        "speculator_type": "eagle3", "seed": EQUAL["seed"],
        "verifier": {"verifier_name_or_path": prep["verifier_dir"]},
        "draft": {"draft_vocab_size": prep["draft_vocab_size"], "d2t_path": os.path.join(out, "d2t.npy"),
                  "t2d_path": os.path.join(out, "t2d.npy"), "draft_attn_impl": "sdpa"},
        "data": {"data_path": os.path.join(out, "ref_data"), "total_seq_len": tokens_per_step,
                 "hidden_states_dtype": "float32", "num_workers": 0, "train_data_ratio": prep["train_data_ratio"]},
        "generation": {"on_missing": "raise"},
        "loss": {"loss_implementation": "eager", "ttt_steps": EQUAL["ttt_steps"]},
        "optimizer": {"lr": EQUAL["lr"]},
        "scheduler": {"scheduler_type": "linear", "scheduler_warmup_ratio": 0.01},
        "trainer": {"epochs": 1, "max_steps": steps, "save_path": os.path.join(run, "checkpoints"),
                    "checkpoint_freq": checkpoint_every, "log_freq": 1},
        "logging": {"log_dir": os.path.join(run, "logs")},
    }}


def train_reference(out: str, steps: int, threads: int = 2, checkpoint_every: float = 0.1,
                    tokens_per_step: int = EQUAL["tokens_per_step"], env: dict | None = None) -> int:
    import yaml

    run = os.path.join(out, "reference")
    os.makedirs(run, exist_ok=True)
    path = os.path.join(run, "config.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(reference_config(out, steps, checkpoint_every, tokens_per_step), f, sort_keys=False)
    # COLUMNS: speculators logs through rich, which wraps a message at the terminal width (80 in a file)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), COLUMNS="400", **(env or {}))
    env.pop("LOCAL_RANK", None)
    with open(os.path.join(run, "train.log"), "a") as logf:  # appended run after run: the resumes stay on record
        return subprocess.call([sys.executable, os.path.join(ROOT, "experiments", "speculators_cpu.py"), "--config",
                                path], env=env, cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT)


def train_ours(out: str, steps: int, variant: str = "") -> int:
    with open(os.path.join(out, "prepare.json")) as f:
        prep = json.load(f)
    flags = our_flags(out, prep["target"], prep["data"], steps, prep["max_length"], prep["draft_vocab_size"],
                      prep["eval_records"], prep["max_records"], variant)
    return subprocess.call([sys.executable, "-m", "launch.train"] + flags, cwd=ROOT)


# ----------------------------------------------------------------------------------------------- serving

def vllm_prompts(out: str, source: str, n_per_category: int, seed: int = 0) -> str:
    """The first turns of ``launch.decode_bench``'s questions (same source, sample and seed) as token ids for
    ``experiments/vllm_cpu.py`` -> the prompts file; ``<file>.ids.json`` names their questions and categories
    (the intervals resample within each category, as decode_bench's)."""
    from confu_jax.assets import strip_asset
    from confu_jax.bench.prompts import first_turn_ids, load_prompts, sample_prompts
    from confu_jax.data.chat import ChatTokenizer

    with open(os.path.join(out, "prepare.json")) as f:
        tokenizer = ChatTokenizer.load(strip_asset(json.load(f)["target"]))
    prompts = sample_prompts(load_prompts(source), n_per_category, seed=seed)
    path = os.path.join(out, "vllm", f"prompts_{source}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump([first_turn_ids(tokenizer, p) for p in prompts], f)
    with open(path[:-5] + ".ids.json", "w") as f:
        json.dump([[str(p.question_id), p.category] for p in prompts], f)
    return path


def vllm_questions(result: dict, questions: list) -> dict:
    """``experiments/vllm_cpu.py --per_prompt`` counters as ``decode_bench``'s per-question counts: a pass is a
    draft round (vLLM's τ = 1 + accepted / drafts counts the prefill's token in no pass, as ours does)."""
    rows = result.get("per_prompt")
    if not rows or len(rows) != len(questions):
        raise ValueError(f"expected a --per_prompt vLLM result of {len(questions)} prompts, got "
                         f"{len(rows) if rows else 'none'}")
    return {q: {"category": c, "emitted": r["drafts"] + r["accepted"], "passes": r["drafts"]}
            for (q, c), r in zip(questions, rows)}


def vllm_compare(row: str, reference: str, ids: str, n_boot: int = 2000) -> dict:
    """τ of two heads served by vLLM, paired by question (``bench.compare``)."""
    from confu_jax.bench.compare import compare

    with open(ids) as f:
        qids = json.load(f)
    with open(row) as f:
        a = json.load(f)
    with open(reference) as f:
        b = json.load(f)
    out = compare({"questions": vllm_questions(a, qids)}, {"questions": vllm_questions(b, qids)}, n_boot=n_boot)
    out.update(row=row, reference=reference, accepted_per_pos={"row": a["accepted_per_pos"],
                                                              "reference": b["accepted_per_pos"]},
               drafts={"row": a["drafts"], "reference": b["drafts"]})
    return out


def training_record(out: str, which: str) -> str:
    """``<out>/<which>_training.json`` for ``launch.release_head --training``: the trainer, its version, the
    patches, the settings (equal and different) and how far it trained -> the file."""
    info = settings(out)
    if which == "reference":
        with open(os.path.join(out, "reference", "checkpoints", "0", "training_state.json")) as f:
            step = int(json.load(f)["global_step"])
        record = dict(info["reference"], step=step, tokens_seen=step * EQUAL["tokens_per_step"],
                      tokens_note="token slots (one packed sequence of tokens_per_step a step)")
    else:  # ours: steps and tokens come from the run itself (launch.release_head --workdir)
        record = {"trainer": "confu_jax", "entry": "experiments/trainer_parity.py train_ours"}
    from confu_jax.data.releases import git_commit

    record.update(equal=info["equal"], different=info["different"], data_rows=info.get("prepare"),
                  commit=git_commit())
    record.setdefault("version", record["commit"])
    path = os.path.join(out, f"{which}_training.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    return path


def reference_heldout(out: str) -> dict:
    """The reference trainer's last held-out evaluation (its ``val/`` line in ``reference/train.log``): KL and
    accuracies per TTT step."""
    import re

    line = None
    with open(os.path.join(out, "reference", "train.log"), errors="replace") as f:
        for text in f:
            if "val/loss_0_epoch=" in text:
                line = text
    if line is None:
        raise ValueError(f"{out}/reference/train.log: no validation line (val/loss_0_epoch=...): did it finish?")
    vals = {k: float(v) for k, v in re.findall(r"val/(\w+?)_epoch=([-\d.eE+]+)", line)}
    steps = range(EQUAL["ttt_steps"])
    return {"kl": [vals[f"loss_{s}"] for s in steps], "acc": [vals[f"full_acc_{s}"] for s in steps],
            "cond_acc": [vals[f"cond_acc_{s}"] for s in steps]}


def ours_heldout(workdir: str) -> dict:
    """Our run's last held-out evaluation (``eval.csv``): KL, accuracy and conditional accuracy per TTT step."""
    import csv

    with open(os.path.join(workdir, "eval.csv")) as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{workdir}/eval.csv: no evaluation row")
    last = rows[-1]
    steps = range(EQUAL["ttt_steps"])
    return {"step": int(last["step"]), "kl": [float(last[f"loss/step{s}"]) for s in steps],
            "acc": [float(last[f"acc/step{s}"]) for s in steps],
            "cond_acc": [float(last[f"cond_acc/step{s}"]) for s in steps]}


def trained_tokens(out: str, which: str) -> dict:
    """Real (non-padding) tokens each trainer trained on, against its token slots: the reference's from its
    per-step profile (tokens/s x step time), ours from throughput.csv (real tokens/s x step time). Equal slots a
    step, so the ratio is each packer's fill."""
    import csv
    import re

    if which == "reference":
        with open(os.path.join(out, "reference", "train.log"), errors="replace") as f:
            pairs = re.findall(r"profile/step_ms=([\d.eE+-]+), profile/tokens_per_s=([\d.eE+-]+)", f.read())
        real = [float(ms) / 1000 * float(tps) for ms, tps in pairs]
    else:
        with open(os.path.join(out, which, "throughput.csv")) as f:
            real = [float(r["throughput/real_tokens_per_s"]) * float(r["throughput/step_s"]) for r in csv.DictReader(f)]
    if not real:
        raise ValueError(f"{out}: no per-step token counts for {which}")
    return {"steps_counted": len(real), "real_tokens": round(sum(real)),
            "fill": sum(real) / (len(real) * EQUAL["tokens_per_step"])}


def conditional_acceptance(accepted_per_pos: list, drafts: int) -> list:
    """vLLM's accepted counts per draft position as our loop's ``acceptance_rate_per_depth``: P(depth k accepted |
    depth k-1 was) — in a chain a position is accepted only after all before it, so count_k / count_{k-1}, with
    the draft rounds as count_0."""
    before = [drafts] + list(accepted_per_pos[:-1])
    return [a / b if b else float("nan") for a, b in zip(accepted_per_pos, before)]


def report(out: str, variants: tuple = (), prompts: tuple = ("mtbench", "grounded"), temperatures: tuple = (0, 1),
           budget: str = "chain:3") -> dict:
    """Everything the parity runs measured, in one record (``docs/results/trainer_parity.json``): the trainers
    and settings; each head's held-out evaluation; per prompt set and temperature, each head's τ with its
    interval and acceptance per depth in our loop, the paired comparisons (our loop and vLLM's CPU build);
    the variants against our default. A missing measurement is an error naming the file."""
    from confu_jax.bench.compare import find_row

    def need(path):
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: not measured yet (experiments/trainer_parity.sh, stage eval)")
        return path

    def load(path):
        with open(need(path)) as f:
            return json.load(f)

    heads = ["ours", "reference"] + [f"ours_{v}" for v in variants]
    rec = {"settings": settings(out), "heldout": {"reference": reference_heldout(out), "ours": ours_heldout(
        os.path.join(out, "ours"))}, "our_loop": {}, "vllm": {}, "variants": {}}
    rec["tokens"] = {"reference": trained_tokens(out, "reference"), "ours": trained_tokens(out, "ours")}
    for v in variants:
        rec["heldout"][f"ours_{v}"] = ours_heldout(os.path.join(out, f"ours_{v}"))
        rec["tokens"][f"ours_{v}"] = trained_tokens(out, f"ours_{v}")
    for p in prompts:
        for t in temperatures:
            key = f"{p}_T{t}"
            cell = {}
            for h in heads:
                row = find_row(need(os.path.join(out, "bench", f"{h}_{p}.json")), "eagle3", float(t), budget)
                cell[h] = {k: row.get(k) for k in ("tau", "tau_ci", "acceptance_rate_per_depth", "n_questions",
                                                   "accept_length_histogram")}
            cell["ours_vs_reference"] = load(os.path.join(out, "bench", f"compare_{p}_T{t}.json"))
            rec["our_loop"][key] = cell
            rec["vllm"][key] = load(os.path.join(out, "vllm", f"compare_{p}_T{t}.json"))
            for v in variants:
                rec["variants"].setdefault(v, {})[key] = load(os.path.join(out, "bench",
                                                                           f"compare_{v}_{p}_T{t}.json"))
    return rec


def report_table(rec: dict) -> str:
    """The record as a markdown table: τ [interval] per head and the paired ratio, our loop and vLLM."""
    lines = ["| set | T | engine | ours τ | speculators τ | ratio ours / speculators | acceptance by depth (ours; "
             "speculators) |", "|---|---|---|---|---|---|---|"]

    def ci(x):
        return f"[{x[0]:.3f}, {x[1]:.3f}]"

    for key, cell in rec["our_loop"].items():
        p, t = key.rsplit("_T", 1)
        for engine, c in (("our loop", cell["ours_vs_reference"]), ("vLLM CPU", rec["vllm"][key])):
            tau, r = c["tau"], c["tau_ratio"]
            if engine == "our loop":
                depth = "; ".join(" / ".join(f"{a:.2f}" for a in (cell[h]["acceptance_rate_per_depth"] or []))
                                  for h in ("ours", "reference"))
            else:
                depth = "; ".join(" / ".join(f"{a:.2f}" for a in conditional_acceptance(
                    c["accepted_per_pos"][h], c["drafts"][h])) for h in ("row", "reference"))
            lines.append(f"| {p} | {t} | {engine} | {tau['row']:.3f} {ci(tau['row_ci'])} | {tau['reference']:.3f} "
                         f"{ci(tau['reference_ci'])} | {r['ratio']:.3f} {ci(r['ci'])} | {depth} |")
    return "\n".join(lines)


def variants_table(rec: dict) -> str:
    """Each variant against our default as a markdown table: held-out KL by TTT step, real tokens trained
    (packing fill), and the paired τ ratio variant / ours [interval] in each set and temperature."""
    keys = list(rec["our_loop"])
    lines = ["| recipe | held-out KL (TTT 0 / 1 / 2) | real tokens (fill) | " + " | ".join(
        f"{k.replace('_T', ' T=')} τ ratio" for k in keys) + " |", "|---|---|---|" + "---|" * len(keys)]
    for name in ["ours"] + list(rec["variants"]):
        head = name if name == "ours" else f"ours_{name}"
        kl = " / ".join(f"{x:.2f}" for x in rec["heldout"][head]["kl"])
        tok = rec["tokens"][head]
        cells = ["1 (the default)" if name == "ours" else "{ratio:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]".format(
            **rec["variants"][name][k]["tau_ratio"]) for k in keys]
        lines.append(f"| {name} | {kl} | {tok['real_tokens']:,} ({tok['fill']:.0%}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def settings(out: str) -> dict:
    from importlib.metadata import version

    info = {"reference": {"trainer": "speculators", "version": version("speculators"),
                          "entry": "experiments/speculators_cpu.py", "patches": list(PATCHES)},
            "equal": EQUAL, "different": {k: {"ours": v[0], "speculators": v[1]} for k, v in DIFFERENT.items()}}
    if os.path.exists(os.path.join(out, "prepare.json")):
        with open(os.path.join(out, "prepare.json")) as f:
            info["prepare"] = json.load(f)
    return info


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stage", choices=("prepare", "hidden", "train_ref", "train_ours", "settings", "vllm_prompts",
                                     "vllm_compare", "training_record", "report"))
    p.add_argument("--which", default="reference", choices=("reference", "ours"), help="training_record: whose")
    p.add_argument("--out", required=True)
    p.add_argument("--target", default="asset:smollm2-135m-instruct")
    p.add_argument("--data", default="releases/data/sharegpt_smollm2")
    p.add_argument("--max_length", type=int, default=EQUAL["max_length"])
    p.add_argument("--draft_vocab", type=int, default=EQUAL["draft_vocab_size"])
    p.add_argument("--eval_records", type=int, default=64)
    p.add_argument("--max_records", type=int, default=0, help="the first N conversations (0: all)")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variant", default="", help=f"train_ours: one change to our run ({', '.join(VARIANTS)})")
    p.add_argument("--checkpoint_every", type=float, default=0.1, help="reference: a fraction of its epoch")
    p.add_argument("--prompts", default="mtbench", help="vllm_prompts: a decode_bench prompt source")
    p.add_argument("--n_per_category", type=int, default=3, help="vllm_prompts: as decode_bench's")
    p.add_argument("--row", help="vllm_compare: a vllm_cpu.py --per_prompt result")
    p.add_argument("--reference", help="vllm_compare: the result it is compared with")
    p.add_argument("--ids", help="vllm_compare: the prompts' question ids (vllm_prompts' .ids.json)")
    p.add_argument("--json_out", default="", help="vllm_compare, report: also write the record here")
    p.add_argument("--variants", default="", help="report: the variants benched (comma-separated)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if a.stage == "prepare":
        print(json.dumps(prepare(a.out, a.target, a.data, a.max_length, a.draft_vocab, a.eval_records,
                                      a.max_records), indent=1))
    elif a.stage == "hidden":
        print("hidden states written:", write_hidden_states(a.out, a.threads))
    elif a.stage == "train_ref":
        return train_reference(a.out, a.steps, a.threads, a.checkpoint_every)
    elif a.stage == "train_ours":
        return train_ours(a.out, a.steps, a.variant)
    elif a.stage == "vllm_prompts":
        print(vllm_prompts(a.out, a.prompts, a.n_per_category))
    elif a.stage == "vllm_compare":
        result = vllm_compare(a.row, a.reference, a.ids)
        if a.json_out:
            with open(a.json_out, "w") as f:
                json.dump(result, f, indent=1)
        print(json.dumps({k: result[k] for k in ("n_questions", "tau", "tau_ratio")}, indent=1))
    elif a.stage == "training_record":
        print(training_record(a.out, a.which))
    elif a.stage == "report":
        rec = report(a.out, tuple(v for v in a.variants.split(",") if v))
        if a.json_out:
            with open(a.json_out, "w") as f:
                json.dump(rec, f, indent=1)
        print(report_table(rec))
        if rec["variants"]:
            print("\n" + variants_table(rec))
    else:
        print(json.dumps(settings(a.out), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
