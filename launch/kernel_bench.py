"""Tree-verification attention: the Pallas kernel vs the XLA path vs a dense masked baseline.

    python -m launch.kernel_bench                      # on an H100: Llama-3.1-8B heads, the grid below
    python -m launch.kernel_bench --seq_lens=4096 --tree_sizes=60 --k_splits=8 --block_m=64
    python -m launch.kernel_bench --registers h100:1   # any host: ptxas' registers / spills per shipped plan

One verification pass of the ConFu target: 2T queries per row (T tree nodes + T contemplate
tokens) against a committed cache of S valid slots, s soft prompts (contemplate rows only) and the
2T tree tokens under an ancestor mask. Shapes default to Llama-3.1-8B attention (32 query / 8 KV
heads, head_dim 128, bf16), S in {1k, 4k, 16k}, T in {30, 60}, s = 16 (the paper's values).

Implementations timed (each jitted; its output checked against the XLA path first):

* ``pallas``: ``confu_jax.kernels.tree_attention.masked_attention_pallas`` (Triton lowering);
* ``xla``: ``masked_attention_reference``, the structured jnp path (the CPU default);
* ``dense``: ``jax.nn.dot_product_attention`` over [cache | prompts | tree] concatenated, with a
  dense mask (what an implementation without structured attention does).

Timing: one compile call, ``--warmup`` calls, then ``--repeats`` batches of ``--iters`` calls
dispatched back to back with one ``block_until_ready`` per batch (so host dispatch overlaps device
work); the median batch time / iters is reported. Figures per implementation: time, effective
bandwidth = the bytes any implementation must move (valid K/V cache read, q/out and tree K/V,
soft prompts, mask) / time, against the device's peak HBM bandwidth, and achieved TFLOP/s. The
arithmetic intensity is printed too: each K/V element serves G·2T query rows, so for 8B at T=60
(480 rows per KV head) the pass sits near the H100's compute/bandwidth ridge, not far below it.

On a non-GPU backend it says so and, unless ``--smoke=false``, runs a tiny interpret-mode check of
the kernel against the XLA path instead (numbers from a CPU interpreter mean nothing for speed).
"""

from __future__ import annotations

import json

from absl import flags

from confu_jax import storage
from confu_jax.bench.kernel_cost import bytes_table, run, smoke

flags.DEFINE_string("model", "llama-3.1-8b", "preset whose attention shapes to use (confu_jax.models.presets)")
flags.DEFINE_list("seq_lens", ["1024", "4096", "16384"], "committed cache lengths S (valid slots per row)")
flags.DEFINE_list("tree_sizes", ["30", "60"], "tree sizes T (the pass has 2T queries)")
flags.DEFINE_integer("batch", 1, "rows per verification pass")
flags.DEFINE_integer("soft_prompts", 16, "soft prompt tokens s (visible to contemplate rows only)")
flags.DEFINE_enum("dtype", "", ["", "bfloat16", "float16", "float32"], "override the preset's dtype")
flags.DEFINE_list("impls", ["pallas", "xla", "dense"], "implementations to time")
flags.DEFINE_integer("warmup", 5, "untimed calls after compilation")
flags.DEFINE_integer("iters", 20, "calls per timed batch")
flags.DEFINE_integer("repeats", 5, "timed batches (the median is reported)")
flags.DEFINE_integer("block_m", 0, "kernel query-row tile (0 = default_tiling)")
flags.DEFINE_integer("block_k", 0, "kernel cache tile (0 = default_tiling)")
flags.DEFINE_integer("k_splits", 0, "kernel cache splits (0 = default_tiling)")
flags.DEFINE_integer("num_warps", 0, "Triton warps per program (0 = default_tiling)")
flags.DEFINE_integer("num_stages", 0, "Triton pipeline stages (0 = default_tiling)")
flags.DEFINE_float("peak_gbps", 0.0, "device peak HBM bandwidth in GB/s (0 = look up the device kind)")
flags.DEFINE_bool("smoke", True, "on a non-GPU backend, run a tiny interpret-mode correctness check")
flags.DEFINE_string("json_out", "", "also write the rows as JSON to this file")
flags.DEFINE_string("registers", "", "instead of timing: compile the kernel at every shipped plan's shapes for "
                    "this GPU (h100:1, h200:1) with XLA:GPU from any host (requirements-compilers.txt) and "
                    "print ptxas' registers and spill bytes per thread; exit status 1 if any kernel spills")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    import jax

    tiling = dict(block_m=FLAGS.block_m, block_k=FLAGS.block_k, k_splits=FLAGS.k_splits,
                  num_warps=FLAGS.num_warps, num_stages=FLAGS.num_stages)
    if FLAGS.registers:
        from confu_jax.bench.kernel_cost import register_table
        from confu_jax.topology import cpu_host

        cpu_host()
        rows = register_table(FLAGS.registers, **tiling)
        if FLAGS.json_out:
            storage.write_text(FLAGS.json_out, json.dumps(rows, indent=1))
        spilled = [r for r in rows if r["spill_stores"] or r["spill_loads"]]
        if spilled:
            raise SystemExit(f"{len(spilled)} of {len(rows)} kernels spill registers")
        return
    backend = jax.default_backend()
    bytes_table(FLAGS.model, [int(s) for s in FLAGS.seq_lens], [int(t) for t in FLAGS.tree_sizes], FLAGS.batch,
                FLAGS.soft_prompts, FLAGS.dtype, tiling)
    if backend != "gpu":
        print(f"kernel_bench: backend is {backend!r}, not a CUDA GPU. The Pallas kernel compiles "
              f"only for CUDA (Triton lowering), and interpret-mode timings on a CPU mean nothing; "
              f"run this on an H100.")
        if FLAGS.smoke:
            err = smoke()
            print(f"CPU smoke check (tiny shapes, interpret mode): max |pallas - xla| = {err:.2e}")
            if not err < 1e-4:
                raise SystemExit(f"smoke check failed: max error {err} >= 1e-4")
        return
    rows = run(FLAGS.model, [int(s) for s in FLAGS.seq_lens], [int(t) for t in FLAGS.tree_sizes],
               FLAGS.batch, FLAGS.soft_prompts, FLAGS.dtype, FLAGS.impls, FLAGS.warmup,
               FLAGS.iters, FLAGS.repeats, tiling, FLAGS.peak_gbps)
    if FLAGS.json_out:
        storage.write_text(FLAGS.json_out, json.dumps(rows, indent=1))
        print(f"wrote {FLAGS.json_out}")


if __name__ == "__main__":
    from confu_jax.user_errors import run

    run("launch.kernel_bench", main)
