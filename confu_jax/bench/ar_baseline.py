"""The plain AR baseline a decode benchmark measures against: our compiled AR loop timed without its
compile (``CompiledAR``), and Hugging Face transformers' ``generate`` on the same GGUF as an outside
reference (torch CPU, greedy; ``load_hf_reference``, ``hf_generate``). ``launch.decode_bench``'s AR mode.
"""

from __future__ import annotations

import os
import time


class CompiledAR:
    """Our jitted AR loop: one compiled program per (batch, bucket), timed runs without compile."""

    def __init__(self, params, cfg, eos_ids, *, max_new_tokens: int, min_bucket: int, unroll_layers=None,
                 mesh=None):
        """``mesh``: decode over it (``decode.sharded``; the weights placed on it once, here)."""
        if mesh is not None:
            from confu_jax.decode.sharded import place_target

            params = place_target(params, cfg, mesh)
        self.params, self.cfg = params, cfg
        self.kw = dict(max_new_tokens=max_new_tokens, eos_ids=eos_ids, min_bucket=min_bucket,
                       unroll_layers=unroll_layers, mesh=mesh)
        self.programs, self.compile_s = {}, 0.0

    def program(self, batch):
        from confu_jax.decode.generate import generate_padded_jit, prepare_ar_inputs

        args, static = prepare_ar_inputs(self.cfg, batch, **self.kw)
        key = (args[0].shape, static["max_len"])
        if key not in self.programs:
            t0 = time.perf_counter()
            self.programs[key] = generate_padded_jit.lower(self.params, *args, **static).compile()
            self.compile_s += time.perf_counter() - t0
        return self.programs[key], args

    def run(self, batch):
        """-> (emitted tokens per row, wall seconds, process CPU seconds of the compiled run)."""
        import jax
        import numpy as np

        fn, args = self.program(batch)
        t0, c0 = time.perf_counter(), time.process_time()
        res = jax.block_until_ready(fn(self.params, *args))
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        toks, n = np.asarray(res.tokens_bn), np.asarray(res.n_generated_b)
        return [toks[b, : n[b]].tolist() for b in range(len(batch))], dt, dc


def load_hf_reference(model_path):
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as e:  # dev dependency only
        raise SystemExit(
            f"transformers reference unavailable ({e}). Install it with "
            "`pip install -r requirements-dev.txt` (torch, transformers, accelerate), or pass --nohf."
        )
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=torch.float32)
    return model.eval()


def hf_generate(model, prompt, eos_ids, pad_id, max_new_tokens):
    import torch

    x = torch.tensor([prompt])
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.no_grad():
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                           do_sample=False, eos_token_id=list(eos_ids), pad_token_id=pad_id)
    return y[0, len(prompt):].tolist(), time.perf_counter() - t0, time.process_time() - c0


def first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
