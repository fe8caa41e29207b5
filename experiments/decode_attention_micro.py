"""Where a continuous-batching decode step goes on this CPU: one layer's cache attention.

    PYTHONPATH=. python experiments/decode_attention_micro.py [B=64]

The generation engine (decode.continuous) attends every row's whole cache (static shapes): at B = 64
rows x 768 slots, SmolLM2's 3 KV heads x 64 dims, one layer reads 75 MB of K/V. Times the
attention the engine runs (``cache_block_state``: K as the dot's left operand, f32 cache) against
a bf16 cache (half the bytes; XLA:CPU converts it to f32 before the dot) and an elementwise
multiply-and-reduce form that could read bf16 in place (f32 and bf16). 8 layers' distinct
buffers a call, median of 15 calls, ms per layer. docs/RESULTS.md "Generation throughput" has the
numbers; run it on an idle machine.
"""
import time, sys
import jax, jax.numpy as jnp, numpy as np
from confu_jax.kernels.blockwise_attention import cache_block_state

B, HKV, G, S, D = int(sys.argv[1]) if len(sys.argv) > 1 else 64, 3, 3, 768, 64
L = 8  # layers per call (distinct buffers, as the unrolled cache)
rng = np.random.default_rng(0)
q = jnp.asarray(rng.standard_normal((B, HKV, G, 1, D)), jnp.float32)
lens = jnp.asarray(rng.integers(300, S, (B, 1)), jnp.int32)
vis = jnp.arange(S)[None, None, :] < lens[:, :, None]
scale = 1 / 8.0

def dot_form(q, ks, vs):
    out = 0.0
    for k, v in zip(ks, vs):
        o, m, l = cache_block_state(q, k, v, vis, scale)
        out = out + o / l[..., None]
    return out

def reduce_form(q, ks, vs):
    out = 0.0
    qf = q[:, :, :, 0, :]  # [B,K,G,D]
    for k, v in zip(ks, vs):
        s = jnp.sum(k.astype(jnp.float32)[:, :, :, None, :] * qf[:, :, None, :, :], -1) * scale  # [B,K,S,G]
        s = jnp.where(vis[:, 0, :][:, None, :, None], s, -1e30)
        m = jnp.max(s, 2)
        p = jnp.exp(s - m[:, :, None, :])
        l = jnp.sum(p, 2)
        o = jnp.sum(p[..., None] * v.astype(jnp.float32)[:, :, :, None, :], 2)  # [B,K,G,D]
        out = out + (o / l[..., None])[:, :, :, None, :]
    return out

def bench(name, f, dtype):
    ks = [jnp.asarray(rng.standard_normal((B, HKV, S, D)), dtype) for _ in range(L)]
    vs = [jnp.asarray(rng.standard_normal((B, HKV, S, D)), dtype) for _ in range(L)]
    g = jax.jit(f)
    r = g(q, ks, vs).block_until_ready()
    ts = []
    for _ in range(15):
        t = time.perf_counter(); g(q, ks, vs).block_until_ready(); ts.append(time.perf_counter() - t)
    t = np.median(ts) / L
    gb = 2 * B * HKV * S * D * jnp.dtype(dtype).itemsize / 1e9
    print(f"{name:22s} {t*1e3:7.2f} ms/layer  {gb/t:6.1f} GB/s of cache", flush=True)
    return np.asarray(r)

a = bench("dot f32 (today)", dot_form, jnp.float32)
bench("dot bf16 (astype)", dot_form, jnp.bfloat16)
c = bench("reduce f32", reduce_form, jnp.float32)
bench("reduce bf16", reduce_form, jnp.bfloat16)
