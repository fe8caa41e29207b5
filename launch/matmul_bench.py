"""Small-row matmuls of a decode / verification step against the memory and compute floors.

    python -m launch.matmul_bench                       # SmolLM2-135M shapes, T = 1, 2, 4, 8, 16 rows
    python -m launch.matmul_bench --model llama-3.2-1b --tokens 1,4

Every projection of every layer (q, k, v, o, gate, up, down; distinct weights per layer, so they
stream from memory as in a real step) plus the LM head, chained in one jitted program, for T new
tokens, in three formulations measured side by side (round-robin, best of ``--repeats``):

* ``xla [in,out]``: ``x @ W`` with kernels stored [in, out] (what the models do; flax ``Dense``);
* ``xla [out,in]``: the same products with kernels stored transposed, ``einsum('ti,oi->to')``
  (the layout a per-backend load-time transpose would choose; the tied LM head is already [V, d]);
* ``numpy``: the same chain with numpy's BLAS (OpenBLAS in the wheels) on the same arrays.

Floors: memory = weight bytes / bandwidth (an XLA reduction over 1 GiB, best of several); compute =
2·T·params / the peak matmul rate (a large square XLA matmul). On a 2-core CPU the compute floor
passes the memory floor around T = 4–8, so rows past that cannot reach the memory floor whatever
the layout. docs/RESULTS.md has a measured table.
"""

from __future__ import annotations

import time

import numpy as np
from absl import flags

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Flags are defined only when run as a program: tests import this module beside other launch
    modules that define some of the same names (``--model``)."""
    flags.DEFINE_string("model", "smollm2-135m", "preset whose projection shapes to use (confu_jax.models.presets)")
    flags.DEFINE_list("tokens", ["1", "2", "4", "8", "16"], "rows T per step")
    flags.DEFINE_integer("layers", 0, "layers to chain (0 = the preset's)")
    flags.DEFINE_integer("repeats", 7, "timed calls per formulation per round (the best is kept)")
    flags.DEFINE_integer("rounds", 2, "round-robin rounds over the formulations")


def _best(fn, n: int) -> float:
    out = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


def layer_shapes(cfg) -> dict:
    """[in, out] of each projection of one decoder layer."""
    d, q, kv, f = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim
    return dict(q=(d, q), k=(d, kv), v=(d, kv), o=(q, d), gate=(d, f), up=(d, f), down=(f, d))


def chain_numpy(x, layers, lm_head_vd):
    """The reference chain (numpy BLAS): the same products as :func:`chain_jax`."""
    for w in layers:
        q = x @ w["q"]
        k, v = x @ w["k"], x @ w["v"]
        x = x + q @ w["o"] + 0.0 * (k[:, :1] + v[:, :1])
        g = x @ w["gate"]
        x = x + (g / (1.0 + np.exp(-np.clip(g, -30, 30))) * (x @ w["up"])) @ w["down"]
        x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5)
    return x @ lm_head_vd.T


def chain_jax(x, layers, lm_head_vd, transposed: bool):
    import jax
    import jax.numpy as jnp

    mm = (lambda a, w: jnp.einsum("ti,oi->to", a, w)) if transposed else (lambda a, w: a @ w)
    for w in layers:
        q = mm(x, w["q"])
        k, v = mm(x, w["k"]), mm(x, w["v"])
        x = x + mm(q, w["o"]) + 0.0 * (k[:, :1] + v[:, :1])
        x = x + mm(jax.nn.silu(mm(x, w["gate"])) * mm(x, w["up"]), w["down"])
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5)
    return jnp.einsum("td,vd->tv", x, lm_head_vd)


def measure(cfg, tokens, n_layers: int, repeats: int, rounds: int, seed: int = 0) -> dict:
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    shapes = layer_shapes(cfg)
    layers = [{k: (rng.standard_normal(s, np.float32) / np.sqrt(s[0])).astype(np.float32) for k, s in shapes.items()}
              for _ in range(n_layers)]
    layers_t = [{k: np.ascontiguousarray(v.T) for k, v in w.items()} for w in layers]
    lm = (rng.standard_normal((cfg.vocab_size, cfg.d_model), np.float32) / np.sqrt(cfg.d_model)).astype(np.float32)
    n_params = sum(v.size for w in layers for v in w.values()) + lm.size
    nbytes = 4 * n_params

    big = jnp.ones((1 << 28,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(big).block_until_ready()
    bandwidth = (1 << 30) / min(_best(lambda: total(big).block_until_ready(), 5) for _ in range(3))
    a = jnp.asarray(rng.standard_normal((1024, 1024), np.float32))
    sq = jax.jit(lambda a: a @ a)
    sq(a).block_until_ready()
    peak_flops = 2 * 1024 ** 3 / _best(lambda: sq(a).block_until_ready(), 10)

    j_layers, j_layers_t, j_lm = jax.tree.map(jnp.asarray, layers), jax.tree.map(jnp.asarray, layers_t), jnp.asarray(lm)
    f_io = jax.jit(lambda x, ws, lm: chain_jax(x, ws, lm, False))
    f_oi = jax.jit(lambda x, ws, lm: chain_jax(x, ws, lm, True))
    rows = []
    for t in tokens:
        x = rng.standard_normal((t, cfg.d_model), np.float32)
        jx = jnp.asarray(x)
        ref = chain_numpy(x, layers, lm)
        for f, ws in ((f_io, j_layers), (f_oi, j_layers_t)):
            np.testing.assert_allclose(np.asarray(f(jx, ws, j_lm)), ref, rtol=1e-2, atol=1e-2)  # fp32 drift over 30 layers
        fns = {"xla [in,out]": lambda: f_io(jx, j_layers, j_lm).block_until_ready(),
               "xla [out,in]": lambda: f_oi(jx, j_layers_t, j_lm).block_until_ready(),
               "numpy": lambda: chain_numpy(x, layers, lm)}
        best = {k: float("inf") for k in fns}
        for _ in range(rounds):
            for k, fn in fns.items():
                best[k] = min(best[k], _best(fn, repeats))
        mem_floor, flop_floor = nbytes / bandwidth, 2 * t * n_params / peak_flops
        rows.append(dict(T=t, memory_floor_ms=mem_floor * 1e3, compute_floor_ms=flop_floor * 1e3,
                         **{f"{k} ms": v * 1e3 for k, v in best.items()},
                         **{f"{k} / floor": v / max(mem_floor, flop_floor) for k, v in best.items()}))
    return dict(weights_mib=nbytes / 2 ** 20, bandwidth_gibs=bandwidth / 2 ** 30, peak_gflops=peak_flops / 1e9,
                rows=rows)


def main(argv):
    del argv
    from confu_jax.models.presets import get_preset

    cfg = get_preset(FLAGS.model)
    res = measure(cfg, [int(t) for t in FLAGS.tokens], FLAGS.layers or cfg.n_layers, FLAGS.repeats, FLAGS.rounds)
    print(f"{FLAGS.model}: {res['weights_mib']:.0f} MiB of fp32 projections + LM head; bandwidth "
          f"{res['bandwidth_gibs']:.1f} GiB/s (XLA sum over 1 GiB), peak matmul {res['peak_gflops']:.0f} GFLOP/s "
          f"(1024^3 XLA dot)")
    names = ("xla [in,out]", "xla [out,in]", "numpy")
    print(f"{'T':>3} {'mem floor':>9} {'flop floor':>10} " + " ".join(f"{n:>22}" for n in names))
    for r in res["rows"]:
        print(f"{r['T']:>3} {r['memory_floor_ms']:7.2f}ms {r['compute_floor_ms']:8.2f}ms "
              + " ".join(f"{r[n + ' ms']:8.2f}ms ({r[n + ' / floor']:4.2f}x)".rjust(22) for n in names))
    print("(x = time / max(memory floor, compute floor))")


if __name__ == "__main__":
    from confu_jax.user_errors import run

    define_flags()
    run("launch.matmul_bench", main)
