"""Here, with the network: the bundle (wheels, prompts, assets, the model in chunks) and the device calls."""

from __future__ import annotations

import glob
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys

from experiments.gpu_campaign.common import (ASSET_FILES, ASSISTANT_PLACEHOLDER, DEFAULT_BUNDLE, MODEL, PLATFORMS,
                                             ROOT, TRAVEL_LIMIT, TRAVEL_MARGIN, WHEELS, dir_bytes, dist_name,
                                             git_commit, now_iso, read_json, resolve_scale, set_aside_releases,
                                             sha256_file, tree_bytes, write_json)



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
    aside = set_aside_releases(scale)  # head releases the campaign does not read: moved out before the calls
    tree = tree_bytes(leave_out=aside)
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
    travel = {"working_tree": tree, "limit": TRAVEL_LIMIT, "set_aside": aside,
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
    if [d for d in aside if os.path.isdir(os.path.join(ROOT, d))]:
        print(f"\nBefore call 1, set aside the head releases the campaign does not read ({', '.join(aside)}): "
              f"python -m experiments.gpu_campaign set_aside --bundle {out}   (restore: ... restore)")
    print_calls(out)
    return 0


def _aside_moves(bundle_dir: str) -> list:
    """[(folder in the tree, its place under <bundle>/set_aside)] for the bundle's set-aside releases."""
    b = read_json(os.path.join(bundle_dir, "bundle.json"), {}) or {}
    return [(os.path.join(ROOT, d), os.path.join(bundle_dir, "set_aside", d))
            for d in (b.get("travel") or {}).get("set_aside", [])]


def cmd_set_aside(args, back: bool = False) -> int:
    """Move the releases the bundle left out of its sizes into ``<bundle>/set_aside`` (git ignores the
    bundle folder, so they no longer travel); ``back``: the ``restore`` command, which moves them back
    (as ``git checkout -- releases/heads`` would)."""
    moved = []
    for tree_dir, aside_dir in _aside_moves(args.bundle):
        src, dst = (aside_dir, tree_dir) if back else (tree_dir, aside_dir)
        if os.path.isdir(src):
            if os.path.exists(dst):
                raise SystemExit(f"{dst} exists already: keep one of {src} and {dst}")
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.move(src, dst)
            moved.append(os.path.relpath(tree_dir, ROOT))
    print(json.dumps({"restored" if back else "set_aside": moved, "working_tree_now": tree_bytes()}))
    return 0


def cmd_restore(args) -> int:
    return cmd_set_aside(args, back=True)


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
        print(f"WARNING: a call would carry more than {TRAVEL_LIMIT / 2**20:.0f} MiB now: set aside the releases "
              f"the campaign does not read ({', '.join(b['travel'].get('set_aside', [])) or 'none'}: python -m "
              "experiments.gpu_campaign set_aside), or, if the tree grew, rerun `python -m experiments.gpu_campaign "
              "bundle`", file=sys.stderr)
        return 1
    return 0
