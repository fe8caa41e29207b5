"""Tree-verification attention kernel: numerics (interpret mode), CUDA lowering, end to end.

The kernel class runs compiled on a CUDA GPU and is skipped elsewhere; its interpret-mode subclass
runs the same cases on CPU (the layout of JAX's tests/pallas/gpu_attention_test.py). Every case is
checked against the jnp reference (the XLA path, itself checked against transformers through the
Llama forward) and, where every query sees a key, against ``jax.nn.dot_product_attention`` over the
concatenated keys with a dense mask.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from confu_jax.kernels.attention_reference import AttendTo
from confu_jax.models.kv_cache import commit, init_cache
from confu_jax.kernels import tree_attention as ta
from confu_jax.models.llama import Llama, init_params
from confu_jax.models.presets import get_preset
from tests.helpers.attention_cases import CASES, Case, ancestor_mask, make_inputs
from tests.helpers.isolation import run_isolated


_FAST_COMPILE = {"xla_backend_optimization_level": 0}


@functools.partial(jax.jit, static_argnames=("interpret", "tiling"), compiler_options=_FAST_COMPILE)
def _kernel(args, interpret, tiling):
    return ta.masked_attention_pallas(*args, interpret=interpret, **dict(tiling))


_reference = jax.jit(lambda args: ta.tree_attention_reference(*args), compiler_options=_FAST_COMPILE)
_dense = jax.jit(lambda args: ta.dense_masked_attention(*args), compiler_options=_FAST_COMPILE)


_init_params = jax.jit(init_params, static_argnums=0, compiler_options=_FAST_COMPILE)


def _tol(c: Case):
    return dict(atol=2e-2, rtol=2e-2) if c.dtype == "bfloat16" else dict(atol=1e-5, rtol=1e-5)


class TestTreeAttentionKernel:
    INTERPRET = False

    def setup_method(self):
        if not self.INTERPRET and jax.default_backend() != "gpu":
            pytest.skip("compiled kernel needs a CUDA GPU; TestTreeAttentionKernelInterpret runs it on CPU")

    @pytest.mark.slow
    @pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
    def test_matches_reference(self, case):
        args = make_inputs(case)
        out = _kernel(args, self.INTERPRET, case.tiling)
        assert out.shape == args[0].shape and out.dtype == args[0].dtype
        # The reference computes in float32 from the same (possibly bf16) inputs.
        ref = _reference(args)
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                                   **_tol(case))
        assert np.isfinite(np.asarray(out, np.float32)).all()

    @pytest.mark.parametrize("case", [CASES[0], CASES[5]], ids=lambda c: c.name)
    def test_matches_jax_dot_product_attention(self, case):
        """JAX's own attention over concatenated keys + dense mask (every row sees its diagonal)."""
        args = make_inputs(case)
        out = _kernel(args, self.INTERPRET, case.tiling)
        dense = _dense(args)
        np.testing.assert_allclose(np.asarray(out), np.asarray(dense), atol=1e-5, rtol=1e-5)

    def test_rows_that_see_nothing_are_zero(self):
        c = dataclasses.replace(CASES[0], lens=(0, 9))
        q, kb, vb, to = make_inputs(c)
        to = dataclasses.replace(to, mask=to.mask.at[0, 2].set(False))  # row (b=0, t=2): no cache, prefix, block key
        assert not bool(to.prefix_visible[0, 2])
        out = np.asarray(_kernel((q, kb, vb, to), self.INTERPRET, c.tiling))
        np.testing.assert_array_equal(out[0, 2], 0.0)
        assert np.abs(out[0, 3]).max() > 0

    def test_unwritten_cache_slots_never_read(self):
        """Slots at or past every row's length may hold anything (NaN here): the kernel never
        loads them (masked loads + a dynamic loop bound), so the output is unchanged."""
        c = CASES[0]
        q, kb, vb, to = make_inputs(c)
        clean = np.asarray(_kernel((q, kb, vb, to), self.INTERPRET, c.tiling))
        slot = jnp.arange(c.s)[None, None, :, None]  # cache [B, Hkv, S, D]
        lens = to.cache_len[:, None, None, None]
        to = dataclasses.replace(to, k_cache=jnp.where(slot >= lens, jnp.nan, to.k_cache),
                                 v_cache=jnp.where(slot >= lens, jnp.nan, to.v_cache))
        dirty = np.asarray(_kernel((q, kb, vb, to), self.INTERPRET, c.tiling))
        np.testing.assert_array_equal(dirty, clean)

    def test_real_rows_ignore_soft_prompts(self):
        """ConFu's invariant: only contemplate rows see the soft prompts, so changing them leaves
        every real-token row bit-identical."""
        c = CASES[0]
        q, kb, vb, to = make_inputs(c)
        a = np.asarray(_kernel((q, kb, vb, to), self.INTERPRET, c.tiling))
        swapped = dataclasses.replace(to, k_prefix=3.0 * to.v_prefix, v_prefix=-to.k_prefix)
        b = np.asarray(_kernel((q, kb, vb, swapped), self.INTERPRET, c.tiling))
        real = ~np.asarray(to.prefix_visible)
        np.testing.assert_array_equal(a[real], b[real])
        assert np.abs(a[~real] - b[~real]).max() > 1e-3


class TestTreeAttentionKernelInterpret(TestTreeAttentionKernel):
    INTERPRET = True


# ----------------------------------------------------------------------------- CUDA lowering


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def _verification_avals(cfg, b: int, t_nodes: int, s: int, p: int):
    """Avals of one target-verification attention call (2T queries) at a model's head shapes."""
    t = 2 * t_nodes
    hq, hkv, d, dt = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dtype
    return (_sds((b, t, hq, d), dt), _sds((b, t, hkv, d), dt), _sds((b, t, hkv, d), dt),
            AttendTo(mask=_sds((b, t, t), bool), k_cache=_sds((b, hkv, s, d), dt), v_cache=_sds((b, hkv, s, d), dt),
                     cache_len=_sds((b,), jnp.int32), k_prefix=_sds((p, hkv, d), dt), v_prefix=_sds((p, hkv, d), dt),
                     prefix_visible=_sds((b, t), bool)))


@pytest.mark.parametrize("t_nodes", [30, 60])
def test_kernel_lowers_for_cuda_at_llama8b_shapes(t_nodes):
    cfg = get_preset("llama-3.1-8b")
    avals = _verification_avals(cfg, b=2, t_nodes=t_nodes, s=4096, p=4)
    with ta.cuda_target():  # which GPU to compile for (JAX 0.11 asks; 0.10 assumed an H100)
        lowered = jax.jit(ta.masked_attention_pallas).trace(*avals).lower(lowering_platforms=("cuda",))
    hlo = lowered.as_text()
    assert "__gpu$xla.gpu.triton" in hlo  # the Triton kernel, not an XLA fallback
    assert "confu_tree_attention" in hlo
    # jax.export for CUDA too (Triton custom calls are not on export's
    # stability list, hence the explicit opt-out).
    with ta.cuda_target():
        exp = export.export(jax.jit(ta.masked_attention_pallas), platforms=["cuda"],
                            disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*avals)
    assert exp.platforms == ("cuda",)
    assert exp.out_avals[0].shape == avals[0].shape and exp.out_avals[0].dtype == jnp.bfloat16
    assert len(exp.mlir_module_serialized) > 0


def test_llama_verification_forward_lowers_for_cuda_with_pallas():
    """The whole tiny target forward (2T queries, cache, soft prompts) with attention_impl='pallas'."""
    cfg = get_preset("tiny").replace(attention_impl="pallas")
    b, t, s, p = 2, 8, 64, 2
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    kv = _sds((cfg.n_layers, b, cfg.n_kv_heads, s, cfg.head_dim), cfg.dtype)
    pk = _sds((cfg.n_layers, p, cfg.n_kv_heads, cfg.head_dim), cfg.dtype)

    def fwd(params, tokens, pos, mask, ck, cv, lens, pk_, pv_, pvis):
        return Llama(cfg).apply({"params": params}, tokens, pos,
                                attend=AttendTo(mask=mask, k_cache=ck, v_cache=cv, cache_len=lens, k_prefix=pk_,
                                                v_prefix=pv_, prefix_visible=pvis)).logits_btv

    with ta.cuda_target():
        hlo = jax.jit(fwd).trace(params, _sds((b, t), jnp.int32), _sds((b, t), jnp.int32),
                                 _sds((b, t, t), bool), kv, kv, _sds((b,), jnp.int32), pk, pk,
                                 _sds((b, t), bool)).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in hlo


def test_resolve_attention_impl():
    assert ta.resolve_attention_impl("xla", "cpu") == "xla"
    assert ta.resolve_attention_impl("pallas", "gpu") == "pallas"
    assert ta.resolve_attention_impl("pallas_interpret", "cpu") == "pallas_interpret"
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        ta.resolve_attention_impl("pallas", "cpu")
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        ta.resolve_attention_impl("flash", "gpu")


# ----------------------------------------------------------------------------- end to end

# Verification tree rooted at the last emitted token: two candidates at depth 1 (node 1 is tried
# first), one child of node 1 at depth 2. A contemplate token follows each node.
_PARENTS = [-1, 0, 0, 1]
_DEPTH = [0, 1, 1, 2]


def _verify_inputs(n_nodes: int):
    """Block mask [2T, 2T] and contemplate flags for nodes [0..T) then contemplates [T..2T)."""
    anc = ancestor_mask(_PARENTS)
    t2 = 2 * n_nodes
    m = np.zeros((t2, t2), bool)
    m[:n_nodes, :n_nodes] = anc
    m[n_nodes:, :n_nodes] = anc  # contemplate i sees node i and its ancestors ...
    m[n_nodes:, n_nodes:] = np.eye(n_nodes, dtype=bool)  # ... and itself
    is_con = np.arange(t2) >= n_nodes
    return m, is_con


def _greedy_tree_decode(cfg, params, prompts, n_iters, drafts_fn, prefix_lphd):
    """Minimal greedy tree-speculative decoding: prefill, then verify a 4-node tree (+4
    contemplate tokens) per iteration, accept the longest greedy-valid path, commit it."""
    model = Llama(cfg)
    b = len(prompts)
    width = 16
    tokens = np.zeros((b, width), np.int32)
    lens = np.array([len(p) for p in prompts], np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    cache = init_cache(cfg.n_layers, b, 64, cfg.n_kv_heads, cfg.head_dim)

    @functools.partial(jax.jit, compiler_options=_FAST_COMPILE)
    def prefill(cache, tokens, lens):
        out = model.apply({"params": params}, tokens, jnp.arange(width)[None].repeat(b, 0),
                          attend=AttendTo(k_cache=cache.k_lbhsd, v_cache=cache.v_lbhsd, cache_len=cache.length_b))
        nxt = jnp.argmax(out.logits_btv[jnp.arange(b), lens - 1], -1)
        return commit(cache, out.k_new_lbthd, out.v_new_lbthd, lens), nxt

    n = len(_PARENTS)
    mask_tt, is_con = _verify_inputs(n)
    con_embed = jnp.asarray(0.02 * np.random.default_rng(7).standard_normal((n, cfg.d_model), np.float32))

    @functools.partial(jax.jit, compiler_options=_FAST_COMPILE)
    def verify(cache, node_tokens_bn):
        pos_n = cache.length_b[:, None] + jnp.asarray(_DEPTH)[None]
        pos = jnp.concatenate([pos_n, pos_n + 1], axis=1)
        emb_n = params["embed"]["embedding"][node_tokens_bn]
        emb = jnp.concatenate([emb_n, jnp.broadcast_to(con_embed, (b,) + con_embed.shape)], 1)
        out = model.apply({"params": params}, None, pos, embeds_btd=emb,
                          attend=AttendTo(mask=jnp.broadcast_to(mask_tt, (b, 2 * n, 2 * n)), k_cache=cache.k_lbhsd,
                                          v_cache=cache.v_lbhsd, cache_len=cache.length_b, k_prefix=prefix_lphd[0],
                                          v_prefix=prefix_lphd[1],
                                          prefix_visible=jnp.broadcast_to(is_con, (b, 2 * n))))
        return jnp.argmax(out.logits_btv[:, :n], -1), out.k_new_lbthd, out.v_new_lbthd

    commit_jit = jax.jit(commit, compiler_options=_FAST_COMPILE)
    cache, nxt = prefill(cache, jnp.asarray(tokens), jnp.asarray(lens))
    emitted = [[int(x)] for x in nxt]
    for it in range(n_iters):
        nodes = np.array([[emitted[r][-1], *drafts_fn(r, len(emitted[r]), it)] for r in range(b)],
                         np.int32)
        argmax_bn, k_new, v_new = verify(cache, jnp.asarray(nodes))
        argmax_bn = np.asarray(argmax_bn)
        paths = np.zeros((b, n), np.int32)
        n_acc = np.zeros((b,), np.int32)
        for r in range(b):
            path, cur = [0], 0
            while True:
                kids = [c for c in range(n) if _PARENTS[c] == cur]
                ok = [c for c in kids if nodes[r, c] == argmax_bn[r, cur]]
                if not ok:
                    break
                cur = ok[0]
                path.append(cur)
            emitted[r] += [int(nodes[r, c]) for c in path[1:]] + [int(argmax_bn[r, cur])]
            paths[r, :len(path)] = path
            n_acc[r] = len(path)
        cache = commit_jit(cache, k_new, v_new, jnp.asarray(n_acc), jnp.asarray(paths))
    return emitted


def _ar_greedy(cfg, params, prompt, n_new, width=32):
    """Plain greedy AR by full causal re-forward (no cache, XLA path): the oracle."""
    model = Llama(cfg)
    fwd = jax.jit(lambda toks, i: jnp.argmax(model.apply(
        {"params": params}, toks, jnp.arange(width)[None]).logits_btv[0, i]),
        compiler_options=_FAST_COMPILE)
    seq = np.zeros((1, width), np.int32)
    seq[0, :len(prompt)] = prompt
    for i in range(len(prompt), len(prompt) + n_new):
        seq[0, i] = int(fwd(jnp.asarray(seq), i - 1))
    return seq[0, len(prompt):len(prompt) + n_new].tolist()


@pytest.mark.slow
def test_greedy_tree_decoding_pallas_matches_xla():
    run_isolated(_greedy_tree_decoding_pallas_matches_xla)


def _greedy_tree_decoding_pallas_matches_xla():
    cfg_xla = get_preset("tiny")
    params = _init_params(cfg_xla, jax.random.PRNGKey(0))
    prompts = [[5, 17, 99, 3, 42], [7, 8, 9, 10, 11, 12, 13, 60, 61]]
    n_iters = 5
    oracle = [_ar_greedy(cfg_xla, params, p, 3 * n_iters + 1) for p in prompts]

    def drafts(r, n_emitted, it):
        """Depth-1 candidates (wrong, right) or (right, wrong) and a depth-2 guess that is right
        on even iterations: paths of length 1, 2 and 3 and sibling acceptance all occur."""
        right1, right2 = oracle[r][n_emitted], oracle[r][n_emitted + 1]
        wrong1 = (right1 + 1) % cfg_xla.vocab_size
        c1, c2 = (right1, wrong1) if it % 2 == 0 else (wrong1, right1)
        return [c1, c2, right2 if it % 3 != 1 else (right2 + 5) % cfg_xla.vocab_size]

    kp = jnp.asarray(np.random.default_rng(3).standard_normal(
        (cfg_xla.n_layers, 2, cfg_xla.n_kv_heads, cfg_xla.head_dim), np.float32))
    out = {}
    for impl in ("xla", "pallas_interpret"):
        cfg = cfg_xla.replace(attention_impl=impl)
        out[impl] = _greedy_tree_decode(cfg, params, prompts, n_iters, drafts, (kp, -kp))
    assert out["pallas_interpret"] == out["xla"]
    for r in range(len(prompts)):  # lossless: speculative greedy == AR greedy
        assert out["xla"][r] == oracle[r][:len(out["xla"][r])]
        assert len(out["xla"][r]) > n_iters + 1  # some drafts were accepted


@pytest.mark.slow
def test_generate_ar_pallas_matches_xla():
    run_isolated(_generate_ar_pallas_matches_xla)


def _generate_ar_pallas_matches_xla():
    generate = pytest.importorskip("confu_jax.decode.generate")
    cfg_xla = get_preset("tiny")
    params = _init_params(cfg_xla, jax.random.PRNGKey(1))
    prompts = [[5, 17, 99, 3, 42], [7, 8, 9]]
    res = {impl: generate.generate_ar(params, cfg_xla.replace(attention_impl=impl), prompts,
                                      max_new_tokens=6, eos_ids=())
           for impl in ("xla", "pallas_interpret")}
    np.testing.assert_array_equal(np.asarray(res["pallas_interpret"].tokens_bn),
                                  np.asarray(res["xla"].tokens_bn))
    oracle = [_ar_greedy(cfg_xla, params, p, 6) for p in prompts]
    np.testing.assert_array_equal(np.asarray(res["xla"].tokens_bn), np.asarray(oracle))


@pytest.mark.slow
def test_config_attention_impl_selects_the_kernel_in_target_verification():
    run_isolated(_config_attention_impl_selects_the_kernel_in_target_verification)


def _config_attention_impl_selects_the_kernel_in_target_verification():
    """``config.model.attention_impl`` (ml_collections) -> ModelSpec -> ConFu ``target.verify``:
    the interpreted kernel reproduces the XLA path's logits, f vectors and node K/V."""
    from configs.tiny import get_config
    from confu_jax.models import target, tree_layout
    from confu_jax.models.spec import model_spec_from_config
    from tests.helpers.model_fakes import random_parents, tiny_params

    specs = {}
    for impl in ("xla", "pallas_interpret"):
        config = get_config("confu")
        config.model.attention_impl = impl
        specs[impl] = model_spec_from_config(config)
    assert specs["xla"].target.attention_impl == "xla"  # the default stays the XLA path
    assert specs["pallas_interpret"].target.attention_impl == "pallas_interpret"
    spec = specs["xla"]
    tp, tr = tiny_params(spec, seed=2)
    rng = np.random.default_rng(5)
    b, t, n_prompt = 2, 6, np.array([7, 3], np.int32)
    cache = init_cache(spec.target.n_layers, b, 32, spec.target.n_kv_heads, spec.target.head_dim)
    # A committed cache of random K/V (rows of different lengths): only attention reads it.
    k0 = rng.standard_normal((spec.target.n_layers, b, 16, spec.target.n_kv_heads,
                              spec.target.head_dim)).astype(np.float32)
    cache = jax.jit(commit, compiler_options=_FAST_COMPILE)(cache, jnp.asarray(k0), jnp.asarray(-k0),
                                                            jnp.asarray(n_prompt))
    parents = np.stack([random_parents(rng, t) for _ in range(b)])
    anc = tree_layout.ancestors_from_parents(jnp.asarray(parents))
    tokens = jnp.asarray(rng.integers(2, spec.target.vocab_size, (b, t)).astype(np.int32))
    con_src = jnp.asarray(rng.standard_normal((b, 3 * spec.d_model)).astype(np.float32))
    outs = {impl: jax.jit(functools.partial(target.verify, s), compiler_options=_FAST_COMPILE)(
                tp, tr["confu"], cache, tokens, anc, con_src)
            for impl, s in specs.items()}
    for a, x in zip(outs["pallas_interpret"], outs["xla"]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(x), atol=2e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- structure


def _count_in_loops(jaxpr, prim: str, inside_while: bool = False) -> tuple[int, int]:
    """(while loops, ``prim`` equations inside while loops) anywhere in a jaxpr tree."""
    loops = hits = 0
    for e in jaxpr.eqns:
        if e.primitive.name == prim and inside_while:
            hits += 1
        is_while = e.primitive.name == "while"
        loops += is_while
        for v in e.params.values():
            for sub in (v if isinstance(v, (list, tuple)) else [v]):
                inner = getattr(sub, "jaxpr", sub)
                inner = getattr(inner, "jaxpr", inner) if not hasattr(inner, "eqns") else inner
                if hasattr(inner, "eqns"):
                    l, h = _count_in_loops(inner, prim, inside_while or is_while)
                    loops, hits = loops + l, hits + h
    return loops, hits


@pytest.mark.parametrize("group_rows, n_groups", [(64, 1), (32, 2)])
def test_each_cache_tile_is_loaded_once_per_row_group(group_rows, n_groups):
    """The kernel's cache loop (one per row group) loads K and V once per tile, for all the
    group's sub-tiles: 60 rows per KV head in 16-row sub-tiles, one group of 4 or two of 2."""
    c = dataclasses.replace(CASES[5], tiling=(("block_k", 16), ("k_splits", 2), ("block_m", 16),
                                              ("group_rows", group_rows), ("block_kt", 16)))
    args = make_inputs(c)
    jaxpr = jax.make_jaxpr(lambda *a: ta.masked_attention_pallas(*a, interpret=True, **dict(c.tiling)))(*args)
    loops, loads = _count_in_loops(jaxpr.jaxpr, "masked_load")
    assert (loops, loads) == (n_groups, 2 * n_groups)
    plan = ta.kernel_plan(c.b, c.t, c.hq, c.hkv, c.d, c.s, has_prefix=True, p_len=c.p, **dict(c.tiling))
    assert (plan.n_groups, plan.n_sub) == (n_groups, 4 // n_groups)


def test_paper_budgets_take_one_128_row_sub_tile_per_row_group():
    """Llama-3.1-8B heads (G = 4, head_dim 128): a row group is one sub-tile of at most 128 rows (two
    sub-tiles' states spill: tests/compile/test_tree_kernel_registers.py), so ConFu at T = 15 (30
    queries, 120 rows per KV head) reads each K/V tile once per (row, KV head), T = 30 (240 rows) in
    two groups, T = 60 (480 rows) in four; 8 warps for the 128-row tile."""
    cfg = get_preset("llama-3.1-8b")
    g = cfg.n_heads // cfg.n_kv_heads
    for t2, groups in ((30, 1), (60, 2), (120, 4)):
        plan = ta.kernel_plan(1, t2, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, 4096, has_prefix=True, p_len=16)
        assert plan.n_rows == g * t2 and plan.n_groups == groups
        assert (plan.n_sub, plan.group_rows, plan.block_m) == (1, 128, 128)
        assert ta.default_tiling(plan.n_rows, 4096, cfg.head_dim)["num_warps"] == 8


def test_prefill_blocks_take_the_xla_path():
    """Blocks longer than MAX_QUERIES never reach the kernel (its tree tiles are a static loop):
    the dispatcher sends them to the blockwise path, and the kernel refuses them itself."""
    from confu_jax.kernels.blockwise_attention import masked_attention_blockwise
    from confu_jax.models.attention import masked_attention

    t = ta.MAX_QUERIES + 8
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, t, 2, 16), np.float32))
    k = jnp.asarray(rng.standard_normal((1, t, 1, 16), np.float32))
    mask = jnp.tril(jnp.ones((t, t), bool))[None]
    out = masked_attention(q, k, k, AttendTo(mask=mask), impl="pallas_interpret")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(masked_attention_blockwise(q, k, k, AttendTo(mask=mask))))
    with pytest.raises(ValueError, match="at most 256 queries per row"):
        ta.masked_attention_pallas(q, k, k, AttendTo(mask=mask), interpret=True)
