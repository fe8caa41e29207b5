"""Bytes and FLOPs of the target forward the decode loops run, against the memory floor.

The floor of one forward of T new tokens against S valid cache slots: every weight read once, the
S slots' K/V read once, the T new K/V entries written. ``forward_cost`` compiles the layer-unrolled
forward for shapes only (no weights: Llama-3.1-8B compiles in seconds) and reads XLA's cost
analysis. Unrolled on purpose: XLA counts a while/scan body once, not once per layer. The CLI is
``launch.decode_cost``; the method and its limits are in docs/decoding.md ("Decode cost against the
memory floor").
"""

from __future__ import annotations

import time


def floor_bytes(cfg, n_params_bytes: int, s_len: int, t: int) -> int:
    """Weights once + S cache slots read (K and V, every layer) + T new K/V entries written."""
    import numpy as np

    item = np.dtype(cfg.dtype).itemsize
    per_token_kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * item
    return n_params_bytes + s_len * per_token_kv + t * per_token_kv


def forward_cost(cfg, s_len: int, t: int, batch: int = 1) -> dict:
    """XLA cost analysis of the compiled layer-unrolled forward of ``t`` tokens against ``s_len`` slots."""
    import jax
    import jax.numpy as jnp

    from confu_jax.models.llama import param_shapes
    from confu_jax.models.unrolled import SplitParams, apply_target
    from confu_jax.kernels.attention_reference import AttendTo

    ps = param_shapes(cfg)
    layer = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), ps["layers"])
    sp = SplitParams({k: v for k, v in ps.items() if k != "layers"}, tuple(layer for _ in range(cfg.n_layers)))
    kv = tuple(jax.ShapeDtypeStruct((batch, cfg.n_kv_heads, s_len, cfg.head_dim), jnp.dtype(cfg.dtype))
               for _ in range(cfg.n_layers))

    def fwd(sp, k, v, lens, toks):
        pos = lens[:, None] + jnp.arange(toks.shape[1])[None]
        out = apply_target(sp, cfg, toks, pos, attend=AttendTo(k_cache=k, v_cache=v, cache_len=lens))
        return out.logits_btv, out.k_new_lbthd, out.v_new_lbthd

    t0 = time.perf_counter()
    compiled = jax.jit(fwd).lower(sp, kv, kv, jax.ShapeDtypeStruct((batch,), jnp.int32),
                                  jax.ShapeDtypeStruct((batch, t), jnp.int32)).compile()
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    n_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(ps))
    floor = floor_bytes(cfg, n_bytes, s_len, t)
    return {"cache": s_len, "tokens": t, "bytes_accessed": float(ca["bytes accessed"]), "flops": float(ca["flops"]),
            "weight_bytes": n_bytes, "floor_bytes": floor, "bytes_over_floor": float(ca["bytes accessed"]) / floor,
            "compile_s": time.perf_counter() - t0}


def stream_bandwidth() -> float:
    """Bytes/s of an XLA sum over 1 GiB of float32: this machine's practical read bandwidth, the
    best of 7 runs (a shared VM's slow spells vary it by 1.5x; the floor is what the memory can do)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((1 << 28,), jnp.float32)
    f = jax.jit(jnp.sum)
    jax.block_until_ready(f(x))
    ts = []
    for _ in range(7):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        ts.append(time.perf_counter() - t0)
    return x.nbytes / min(ts)


def split_iteration(head, plan, prompt, max_len: int, repeats: int, temperature: float = 0.0) -> dict:
    """Wall time of one speculative iteration split into draft / verify / accept+commit (ms).

    Three AOT-compiled programs on the same loop state (after prefill): the draft tree alone,
    draft + target verification pass + acceptance rule, and the whole ``loop.iteration``; the
    parts are their differences (medians over ``repeats`` calls each). The layer-unrolled weight
    buffers are made once, outside the timed calls, as the loop does.
    """
    import jax
    import jax.numpy as jnp

    from confu_jax.decode import drafting, loop
    from confu_jax.decode.drafter import DraftInput
    from confu_jax.decode.plans import DraftPlan
    from confu_jax.models.unrolled import split_layers

    target, dp = head.target, head.drafter_params
    drafter = drafting.HeadDrafter(plan) if isinstance(plan, DraftPlan) else plan
    args, static = loop.prepare_spec_inputs(target.config, drafter, [prompt], max_new_tokens=8, eos_ids=(),
                                            max_len=max_len, temperature=temperature)
    tokens_bt, lengths_b, temp, top_p, eos_e, key = args
    kw = dict(max_new_tokens=static["max_new_tokens"], max_len=static["max_len"])
    rule = static["rule"]
    if static["unroll_layers"]:
        target = jax.jit(lambda t: t.replace(params=split_layers(t.params, t.config)))(target)
    temp, top_p = jnp.float32(temp), jnp.float32(top_p)
    params = (target, dp)
    state = jax.jit(lambda p: loop._prefill(*p, drafter, tokens_bt, lengths_b, temp, top_p, eos_e, key,
                                            **kw))(params)

    def draft(p, s):
        return drafter.propose(*p, s.drafter, DraftInput(s.root_b, s.cache.length_b - 1, s.done_b, s.key,
                                                         temp, top_p))

    def draft_verify(p, s):
        return loop._verify(*p, rule, s, draft(p, s), s.key, temp, top_p)[1]

    def whole(p, s):
        return loop.iteration(*p, drafter, rule, s, temp, top_p, eos_e, **kw)

    runs = {name: jax.jit(fn).lower(params, state).compile()
            for name, fn in (("draft", draft), ("draft_verify", draft_verify), ("iteration", whole))}
    samples = {name: [] for name in runs}
    for run in runs.values():
        jax.block_until_ready(run(params, state))
    for _ in range(repeats):  # round-robin: a slow spell hits the three alike
        for name, run in runs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(run(params, state))
            samples[name].append(time.perf_counter() - t0)
    times = {name: sorted(v)[len(v) // 2] for name, v in samples.items()}
    return {"draft_ms": times["draft"] * 1e3, "verify_ms": (times["draft_verify"] - times["draft"]) * 1e3,
            "accept_commit_ms": (times["iteration"] - times["draft_verify"]) * 1e3,
            "iteration_ms": times["iteration"] * 1e3, "rule": rule.name}
