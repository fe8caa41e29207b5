"""The tree-attention kernel's cost, measured and modelled: the HBM bytes one verification pass must
move (``bytes_moved``) and what the Pallas kernel's tiling really moves (``kernel_bytes``), FLOPs,
random cases at a target's shapes, and timed runs of every implementation against those bytes.
``launch.kernel_bench`` is the CLI; ``experiments/accelerator_scale.sh`` runs it on a GPU. Device
peaks come from ``confu_jax.devices`` (the table the training log's MFU uses too).
"""

from __future__ import annotations

import dataclasses

import time

import numpy as np

from confu_jax.devices import device_peaks

def bytes_moved(b: int, t2: int, hq: int, hkv: int, d: int, s_valid: int, p: int, itemsize: int) -> int:
    """The minimum HBM traffic of one pass: read valid K/V cache, q, tree K/V, soft prompts and
    the mask; write the output. Kernel-private traffic (split partials) is overhead, not counted."""
    cache = 2 * b * s_valid * hkv * d * itemsize
    tree = 2 * b * t2 * hkv * d * itemsize
    q_out = 2 * b * t2 * hq * d * itemsize
    prompts = 2 * p * hkv * d * itemsize
    mask = b * t2 * t2 + b * t2  # bool block mask + prefix visibility
    return cache + tree + q_out + prompts + mask


def kernel_bytes(b: int, t2: int, hq: int, hkv: int, d: int, s_valid: int, p: int, itemsize: int,
                 s_capacity: int = 0, **tiling) -> dict:
    """What the Pallas kernel really reads and writes in one pass, from its tiling
    (``tree_attention.kernel_plan``, the same resolution the wrapper launches), per category:

    * ``cache_hbm``: the valid K/V slots, once per (batch row, KV head) — each split's program loads
      its tiles once for all the rows of a row group; ``cache_l2``: the reloads of the same slots by
      the program's further row groups (issued right after the first group finished with them, a
      range of ``split_len`` slots: L2-resident unless evicted), counted apart;
    * ``q``: every program of a (batch row, KV head) reads the padded query rows (``m_pad``);
    * ``tree`` / ``prompts``: the block's and the soft prompts' K/V, read by the one extra program
      once per row group; ``masks``: lengths (cache programs), prefix visibility and the int8 block
      mask (extra program), per padded row;
    * ``partials``: every program writes a normalised [m_pad, d] partial (input dtype) and an f32
      log-sum-exp; the epilogue reads them all back and writes the output (``epilogue``);
    * ``glue``: XLA work around the kernel: q transposed and padded to [B, Hkv, m_pad, d], the mask
      and per-row arrays repeated to m_pad rows, the tree K/V padded.
    ``s_capacity``: the cache's slots (the splits divide it; default ``s_valid``). Also returned:
    ``cache_tile_loads`` / ``tree_tile_loads``, the K/V tiles one (batch row, KV head) loads over all
    its programs — what the interpreted kernel counts (``count_tiles``, tests/e2e/test_kernel_bench.py).
    Returns the categories, ``total_hbm`` (everything except ``cache_l2``) and the plan."""
    from confu_jax.kernels.tree_attention import kernel_plan

    pl_ = kernel_plan(b, t2, hq, hkv, d, s_capacity or s_valid, has_prefix=p > 0, p_len=p, **tiling)
    per_split = [min(pl_.split_len, max(0, s_valid - j * pl_.split_len)) for j in range(pl_.k_splits)]
    tile_loads = dict(cache_tile_loads=pl_.n_groups * sum(-(-n // pl_.block_k) for n in per_split),
                      tree_tile_loads=pl_.n_groups * (pl_.t_pad // pl_.block_kt))
    heads = b * hkv
    n_j = pl_.k_splits + 1
    kv_slot = 2 * d * itemsize
    out = dict(
        cache_hbm=heads * s_valid * kv_slot,
        cache_l2=heads * s_valid * kv_slot * (pl_.n_groups - 1),
        q=heads * n_j * pl_.m_pad * d * itemsize,
        tree=heads * pl_.n_groups * pl_.t_pad * kv_slot,
        prompts=heads * pl_.n_groups * pl_.p_pad * kv_slot,
        masks=heads * (pl_.k_splits * pl_.m_pad * 4 + pl_.m_pad * (4 + pl_.t_pad)),
        partials=heads * n_j * pl_.m_pad * (d * itemsize + 4),
        epilogue=heads * n_j * pl_.m_pad * (d * itemsize + 4) + b * t2 * hq * d * itemsize,
        glue=2 * b * t2 * hq * d * itemsize + heads * pl_.m_pad * d * itemsize
        + b * pl_.m_pad * (pl_.t_pad + 8) + 2 * 2 * b * pl_.t_pad * hkv * d * itemsize,
    )
    out["total_hbm"] = sum(v for k, v in out.items() if k != "cache_l2")
    out.update(tile_loads, plan=pl_)
    return out


def flops(b: int, t2: int, hq: int, d: int, s_valid: int, p: int) -> int:
    """QK^T and PV over every visible-or-not key of the three blocks (what the kernel computes)."""
    return 4 * b * hq * t2 * (s_valid + p + t2) * d


def make_case(cfg, b: int, t_nodes: int, s_len: int, p: int, dtype, seed: int = 0):
    """Random q/K/V at a model's head shapes, an ancestor mask of a 4-ary BFS tree (each
    contemplate token sees its node's ancestors-and-node and itself), full-length cache rows."""
    import jax
    import jax.numpy as jnp

    t2 = 2 * t_nodes
    hq, hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    ks = jax.random.split(jax.random.PRNGKey(seed), 7)
    from confu_jax.models.tree_layout import ancestors_from_parents

    parents = np.array([[-1] + [(i - 1) // 4 for i in range(1, t_nodes)]], np.int32)
    anc = np.asarray(ancestors_from_parents(jnp.asarray(parents)))[0]
    mask = np.zeros((t2, t2), bool)
    mask[:t_nodes, :t_nodes] = anc
    mask[t_nodes:, :t_nodes] = anc
    mask[t_nodes:, t_nodes:] = np.eye(t_nodes, dtype=bool)
    pvis = np.arange(t2) >= t_nodes
    from confu_jax.kernels.attention_reference import AttendTo

    rnd = lambda k, shape: jax.random.normal(k, shape, dtype)  # noqa: E731
    return (rnd(ks[0], (b, t2, hq, d)), rnd(ks[1], (b, t2, hkv, d)), rnd(ks[2], (b, t2, hkv, d)),
            AttendTo(mask=jnp.asarray(np.broadcast_to(mask, (b, t2, t2))), k_cache=rnd(ks[3], (b, hkv, s_len, d)),
                     v_cache=rnd(ks[4], (b, hkv, s_len, d)), cache_len=jnp.full((b,), s_len, jnp.int32),
                     k_prefix=rnd(ks[5], (p, hkv, d)), v_prefix=rnd(ks[6], (p, hkv, d)),
                     prefix_visible=jnp.asarray(np.broadcast_to(pvis, (b, t2)))))


def time_fn(fn, args, warmup: int, iters: int, repeats: int):
    """(median seconds per call, compile+first-call seconds)."""
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first_s = time.perf_counter() - t0
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    per_call = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(iters)]
        jax.block_until_ready(outs)
        per_call.append((time.perf_counter() - t0) / iters)
    return float(np.median(per_call)), first_s


def implementations(interpret: bool = False, **tiling):
    from confu_jax.kernels import tree_attention as ta

    tiling = {k: v for k, v in tiling.items() if v}
    return {
        "pallas": lambda *a: ta.masked_attention_pallas(*a, interpret=interpret, **tiling),
        "xla": ta.tree_attention_reference,
        "dense": ta.dense_masked_attention,
    }


def smoke() -> float:
    """Tiny interpret-mode run of the kernel on the benchmark's mask pattern; returns the max
    |pallas - xla| (float32). Checks the harness end to end where no GPU is available."""
    import jax
    import jax.numpy as jnp

    from confu_jax.models.presets import get_preset

    cfg = get_preset("tiny")
    args = make_case(cfg, b=2, t_nodes=5, s_len=70, p=3, dtype=jnp.float32)
    impls = implementations(interpret=True, block_k=16, k_splits=2)
    ref = jax.jit(impls["xla"])(*args)
    err = 0.0
    for name in ("pallas", "dense"):
        out = jax.jit(impls[name])(*args)
        err = max(err, float(jnp.max(jnp.abs(out - ref))))
    return err


def run(model: str, seq_lens, tree_sizes, batch: int, soft_prompts: int, dtype_name: str,
        impl_names, warmup: int, iters: int, repeats: int, tiling: dict, peak_gbps: float = 0.0,
        interpret: bool = False):
    """Time every implementation on every (S, T); returns one dict per (S, T, impl).

    ``interpret`` runs the kernel under Pallas' interpreter: only for exercising this harness
    on CPU (tests), never for numbers."""
    import jax
    import jax.numpy as jnp

    from confu_jax.models.presets import get_preset

    cfg = get_preset(model)
    dtype = jnp.dtype(dtype_name or cfg.dtype)
    dev = jax.devices()[0]
    peak_bw, peak_tf = device_peaks(dev.device_kind)
    peak_bw = peak_gbps or peak_bw
    g = cfg.n_heads // cfg.n_kv_heads
    print(f"device: {dev.device_kind} (peak {peak_bw or 'unknown'} GB/s, {peak_tf or 'unknown'} "
          f"bf16 TFLOP/s); {model}: Hq={cfg.n_heads} Hkv={cfg.n_kv_heads} hd={cfg.head_dim} "
          f"{dtype.name}; batch={batch}, s={soft_prompts}")
    if peak_bw and peak_tf:
        print(f"ridge point {peak_tf * 1e3 / peak_bw:.0f} flop/B")
    impls = implementations(interpret=interpret, **tiling)
    rows = []
    hdr = f"{'S':>6} {'T':>3} {'impl':>7} {'us':>9} {'GB/s':>8} {'%peak':>6} {'TFLOP/s':>8} {'vs xla':>7} {'max|err|':>9}"
    print(hdr)
    for s_len in seq_lens:
        for t_nodes in tree_sizes:
            t2 = 2 * t_nodes
            args = make_case(cfg, batch, t_nodes, s_len, soft_prompts, dtype)
            nbytes = bytes_moved(batch, t2, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, s_len,
                                 soft_prompts, dtype.itemsize)
            nflops = flops(batch, t2, cfg.n_heads, cfg.head_dim, s_len, soft_prompts)
            ref = jax.jit(impls["xla"])(*args).astype(jnp.float32)
            timings = {}
            for name in impl_names:
                fn = jax.jit(impls[name])
                err = float(jnp.max(jnp.abs(fn(*args).astype(jnp.float32) - ref)))
                sec, first_s = time_fn(fn, args, warmup, iters, repeats)
                timings[name] = sec
                gbps = nbytes / sec / 1e9
                row = dict(S=s_len, T=t_nodes, impl=name, us=sec * 1e6, gbps=gbps,
                           pct_peak=(100 * gbps / peak_bw) if peak_bw else None,
                           tflops=nflops / sec / 1e12, max_abs_err=err, first_call_s=first_s,
                           flop_per_byte=nflops / nbytes, rows_per_kv_head=g * t2,
                           device=dev.device_kind)
                rows.append(row)
            for row in rows[-len(impl_names):]:
                vs = timings.get("xla", float("nan")) / (row["us"] * 1e-6)
                pct = f"{row['pct_peak']:6.1f}" if row["pct_peak"] is not None else f"{'n/a':>6}"
                print(f"{row['S']:>6} {row['T']:>3} {row['impl']:>7} {row['us']:9.1f} {row['gbps']:8.1f} "
                      f"{pct} {row['tflops']:8.1f} {vs:6.2f}x {row['max_abs_err']:9.2e}")
            kb = kernel_bytes(batch, t2, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, s_len, soft_prompts,
                              dtype.itemsize, **{k: v for k, v in tiling.items()
                                                 if k in ("block_m", "block_k", "k_splits") and v})
            kp = kb["plan"]
            for row in rows[-len(impl_names):]:
                if row["impl"] == "pallas":
                    row.update(kernel_mb=kb["total_hbm"] / 1e6, kernel_l2_mb=kb["cache_l2"] / 1e6,
                               kernel_bytes_ratio=kb["total_hbm"] / nbytes)
            print(f"       (S={s_len}, T={t_nodes}: {nbytes / 1e6:.1f} MB moved at least, "
                  f"{nflops / nbytes:.0f} flop/B, {g * t2} query rows per KV head)")
            print(f"       kernel: {kb['total_hbm'] / 1e6:.1f} MB from HBM = {kb['total_hbm'] / nbytes:.2f}x the minimum "
                  f"(cache {kb['cache_hbm'] / 1e6:.1f}, q {kb['q'] / 1e6:.2f}, partials+epilogue "
                  f"{(kb['partials'] + kb['epilogue']) / 1e6:.2f}, glue {kb['glue'] / 1e6:.2f}) + "
                  f"{kb['cache_l2'] / 1e6:.1f} MB of L2 reloads; {kp.k_splits} splits of {kp.split_len} slots, "
                  f"{kp.n_groups} row group(s) of {kp.group_rows} rows")
    return rows


def bytes_table(model: str, seq_lens, tree_sizes, batch: int, soft_prompts: int, dtype_name: str,
                tiling: dict) -> list:
    """The bytes model for every (S, T) of the grid (no device needed): the kernel's HBM bytes
    against the minimum, and its L2 reloads."""
    import jax.numpy as jnp

    from confu_jax.models.presets import get_preset

    cfg = get_preset(model)
    item = jnp.dtype(dtype_name or cfg.dtype).itemsize
    g = cfg.n_heads // cfg.n_kv_heads
    rows = []
    print(f"bytes model ({model}, batch {batch}, s={soft_prompts}, {item}-byte elements): what the kernel reads "
          f"and writes vs the minimum")
    print(f"{'S':>6} {'T':>3} {'2T':>4} {'rows/KVh':>8} {'groups':>6} {'splits':>6} {'min MB':>8} {'kernel MB':>9} "
          f"{'ratio':>6} {'L2 MB':>7}")
    for s_len in seq_lens:
        for t_nodes in tree_sizes:
            for t2 in (t_nodes, 2 * t_nodes):  # EAGLE-3 verifies T queries, ConFu 2T
                need = bytes_moved(batch, t2, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, s_len, soft_prompts, item)
                kb = kernel_bytes(batch, t2, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, s_len, soft_prompts, item,
                                  **{k: v for k, v in tiling.items() if k in ("block_m", "block_k", "k_splits") and v})
                kp = kb["plan"]
                rows.append(dict(S=s_len, T=t_nodes, queries=t2, rows_per_kv_head=g * t2, row_groups=kp.n_groups,
                                 k_splits=kp.k_splits, min_mb=need / 1e6, kernel_mb=kb["total_hbm"] / 1e6,
                                 ratio=kb["total_hbm"] / need, l2_mb=kb["cache_l2"] / 1e6))
                r = rows[-1]
                print(f"{s_len:>6} {t_nodes:>3} {t2:>4} {g * t2:>8} {kp.n_groups:>6} {kp.k_splits:>6} "
                      f"{r['min_mb']:8.2f} {r['kernel_mb']:9.2f} {r['ratio']:6.2f} {r['l2_mb']:7.2f}")
    return rows


# The plans a user reaches (README, docs/decoding.md, the paper's budgets T = 30 / 60) and the presets
# shipped: the verification blocks the kernel takes. EAGLE-3 verifies the tree's nodes (root
# included); ConFu also a contemplate token after each, with the soft prompts.
SHIPPED_PLANS = ("chain:3", "chain:4", "dynamic:6,8,30", "dynamic:6,10,60")
SHIPPED_MODELS = ("smollm2-135m", "llama-3.2-3b", "llama-3.1-8b", "qwen3-8b")


def shipped_kernel_calls(models=SHIPPED_MODELS, plans=SHIPPED_PLANS, soft_prompts: int = 16) -> list:
    """One row per distinct kernel the shipped plans compile: {model, head, plan, queries, dtype,
    soft_prompts, hq, hkv, d}. SmolLM2 in bfloat16 and float32 (its CPU recipe's dtype, which the GPU
    campaign keeps). Calls that resolve to the same kernel (tiling, head_dim, dtype, soft prompts or not) are
    listed once, under the first model and plan that reach it."""
    from confu_jax.decode.plans import parse_plan
    from confu_jax.kernels.tree_attention import kernel_plan
    from confu_jax.models.presets import get_preset

    rows, seen = [], set()
    for model in models:
        cfg = get_preset(model)
        for dtype in ("bfloat16", "float32") if model.startswith("smollm2") else (cfg.dtype,):
            for plan_text in plans:
                plan = parse_plan(plan_text)
                for head, t, p in (("eagle3", plan.n_nodes_total, 0),
                                   ("confu", plan.n_nodes_total + plan.n_contemplates, soft_prompts)):
                    kp = kernel_plan(1, t, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, 4096, has_prefix=p > 0,
                                     p_len=p)
                    key = (kp.block_m, kp.n_sub, kp.block_k, kp.t_pad, kp.block_kt, kp.p_pad, cfg.head_dim, dtype)
                    if key in seen:
                        continue
                    seen.add(key)
                    rows.append(dict(model=model, head=head, plan=plan_text, queries=t, dtype=dtype,
                                     soft_prompts=p, hq=cfg.n_heads, hkv=cfg.n_kv_heads, d=cfg.head_dim))
    return rows


def kernel_registers(call: dict, topology: str = "h100:1", s_len: int = 4096, **tiling) -> dict:
    """The kernel of one ``shipped_kernel_calls`` row compiled for ``topology``'s GPU by XLA:GPU (from
    any host: ``confu_jax.topology``), with ptxas' registers and spill bytes per thread -> the row
    plus {block_m, group_rows, num_warps, registers, spill_stores, spill_loads}."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from confu_jax import topology as tp
    from confu_jax.kernels.tree_attention import default_tiling, kernel_plan, masked_attention_pallas

    topo = tp.get_topology(topology)
    if topo.platform != "gpu":
        raise ValueError(f"the tree-attention kernel compiles for CUDA GPUs; {topology!r} is {topo.platform}")
    sh = SingleDeviceSharding(topo.devices[0])
    dt = jnp.dtype(call["dtype"])
    t, hq, hkv, d, p = call["queries"], call["hq"], call["hkv"], call["d"], call["soft_prompts"]

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

    from confu_jax.kernels.attention_reference import AttendTo

    to = AttendTo(mask=sds((1, t, t), jnp.bool_), k_cache=sds((1, hkv, s_len, d), dt), v_cache=sds((1, hkv, s_len, d), dt),
                  cache_len=sds((1, t), jnp.int32))
    if p:
        to = dataclasses.replace(to, k_prefix=sds((p, hkv, d), dt), v_prefix=sds((p, hkv, d), dt),
                                 prefix_visible=sds((1, t), jnp.bool_))
    args = [sds((1, t, hq, d), dt), sds((1, t, hkv, d), dt), sds((1, t, hkv, d), dt), to]
    tiling = {k: v for k, v in tiling.items() if v}
    lowered = jax.jit(lambda *a: masked_attention_pallas(*a, **tiling)).trace(*args).lower()
    usage = tp.gpu_kernel_usage(lowered, "confu_tree_attention")
    if len(usage) != 1:
        raise RuntimeError(f"expected one confu_tree_attention kernel in the compiled program, found {sorted(usage)}")
    (u,) = usage.values()
    plan_tiling = {k: v for k, v in tiling.items() if k not in ("num_warps", "num_stages")}
    kp = kernel_plan(1, t, hq, hkv, d, s_len, has_prefix=p > 0, p_len=p, **plan_tiling)
    warps = tiling.get("num_warps") or default_tiling(kp.n_rows, s_len, d, hkv)["num_warps"]
    return dict(call, block_m=kp.block_m, group_rows=kp.group_rows, row_groups=kp.n_groups, num_warps=warps, **u)


def register_table(topology: str = "h100:1", **tiling) -> list:
    """``kernel_registers`` of every shipped kernel call; prints one line each."""
    rows = []
    print(f"{'model':<14} {'head':<7} {'plan':<16} {'queries':>7} {'dtype':<9} {'block_m':>7} {'groups':>6} "
          f"{'warps':>5} {'registers':>9} {'spill st/ld B':>13}")
    for call in shipped_kernel_calls():
        r = kernel_registers(call, topology, **tiling)
        rows.append(r)
        print(f"{r['model']:<14} {r['head']:<7} {r['plan']:<16} {r['queries']:>7} {r['dtype']:<9} {r['block_m']:>7} "
              f"{r['row_groups']:>6} {r['num_warps']:>5} {r['registers']:>9} "
              f"{str(r['spill_stores']) + '/' + str(r['spill_loads']):>13}", flush=True)
    return rows
