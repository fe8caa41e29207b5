"""Decoding over a device mesh (``confu_jax.decode.sharded``) on the 8 fake CPU devices.

Properties: (1) sharded greedy output equals the single-device output token for token (AR,
EAGLE-3 and ConFu, chain and tree, batch 4) on meshes that split rows, heads/MLP/vocab and model
width; (2) the caches and per-row state get the training table's layouts; (3) Llama-3.1-8B's
loops lower on a 1×8 ``tensor`` mesh with each device holding 1/8 of the sharded weights plus the
replicated rest, and lower for TPU when this JAX can.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from confu_jax.decode.drafting import HeadDrafter
from confu_jax import sharding as shd
from confu_jax.decode import loop, plans, sharded, tracing
from confu_jax.decode.generate import generate_ar, prepare_ar_inputs
from confu_jax.decode.stopping import StopReason
from confu_jax.models.kv_cache import init_cache
from confu_jax.models.presets import get_preset
from confu_jax.models.spec import HeadConfig, ModelSpec
from tests.helpers.loop_fixtures import generated_rows, make, prompts_for

VOCAB = 24
N_NEW = 16


@pytest.fixture(scope="module")
def reference():
    """Single-device greedy AR output of the tiny target (equal to single-device speculative
    output: tests/unit/test_spec_loop.py)."""
    spec, tp, _ = make("eagle3", VOCAB)
    ar = generate_ar(tp, spec.target, prompts_for(VOCAB), max_new_tokens=N_NEW, eos_ids=())
    return tp, generated_rows(ar, 4)


def test_parse_mesh_and_errors():
    m = sharded.parse_mesh("data=2,tensor=4")
    assert dict(m.shape) == {"data": 2, "fsdp": 1, "tensor": 4}
    assert dict(sharded.parse_mesh("").shape) == {"data": 1, "fsdp": 1, "tensor": 1}
    with pytest.raises(ValueError, match="not AXIS=SIZE"):
        sharded.parse_mesh("model=2")
    with pytest.raises(ValueError, match="needs 16 devices; 8 visible"):
        sharded.parse_mesh("tensor=16")
    spec, _, _ = make("eagle3", VOCAB)
    args, _ = prepare_ar_inputs(spec.target, prompts_for(VOCAB)[:3], max_new_tokens=2)
    with pytest.raises(ValueError, match="3 prompt rows do not divide over the mesh's batch axes"):
        sharded.place_request(args, sharded.parse_mesh("data=2,tensor=4"))


def test_state_and_cache_layouts():
    mesh = sharded.parse_mesh("data=2,fsdp=2,tensor=2")
    rows = ("data", "fsdp")
    stacked = init_cache(3, 4, 32, 2, 16)
    per_layer = init_cache(3, 4, 32, 2, 16, per_layer=True)
    assert sharded.cache_shardings(stacked, mesh).k_lbhsd.spec == P(None, rows, "tensor", None, None)
    assert all(s.spec == P(rows, "tensor", None, None) for s in sharded.cache_shardings(per_layer, mesh).v_lbhsd)
    assert sharded.cache_shardings(stacked, mesh).length_b.spec == P(rows)
    # constrain_tree pins exactly these layouts inside the loops (name letters: b -> rows, h -> KV heads)
    state = (stacked, {"tokens_bn": jnp.zeros((4, 5), jnp.int32), "key": jax.random.PRNGKey(0)})

    def f(s):
        with shd.activation_mesh(mesh):
            return sharded.constrain_tree(s)

    out = jax.jit(f)(state)

    def laid_out(x, *spec):
        return x.sharding.is_equivalent_to(NamedSharding(mesh, P(*spec)), x.ndim)

    assert laid_out(out[0].k_lbhsd, None, rows, "tensor", None, None)
    assert laid_out(out[0].length_b, rows)
    assert laid_out(out[1]["tokens_bn"], rows, None)
    assert out[1]["key"].sharding.is_fully_replicated  # a [2] key is not a row axis


# unroll_layers: per-layer weights and cache buffers (the CPU default) and the scanned, stacked form
# GPU/TPU run (the 8B lowering below uses it too)
@pytest.mark.slow
@pytest.mark.parametrize("unroll_layers", [True, False])
def test_sharded_ar_equals_single_device(reference, unroll_layers):
    tp, ref = reference
    mesh = sharded.parse_mesh("data=4,tensor=2")
    cfg = make("eagle3", VOCAB)[0].target
    placed = sharded.place_target(tp, cfg, mesh)
    specs = {shd.path_str(p): s.spec for p, s in jax.tree_util.tree_flatten_with_path(
        sharded.target_shardings(tp, cfg, mesh))[0]}
    assert any("tensor" in str(s) for k, s in specs.items() if k.endswith("q_proj/kernel")), specs
    out = generate_ar(placed, cfg, prompts_for(VOCAB), max_new_tokens=N_NEW, eos_ids=(), mesh=mesh,
                      unroll_layers=unroll_layers)
    # rows stay on their data shard
    assert out.tokens_bn.sharding.is_equivalent_to(NamedSharding(mesh, P("data", None)), 2)
    assert generated_rows(out, 4) == ref


# jaxlib 0.11.2's XLA:CPU aborts the process compiling this loop under the Shardy partitioner
# (hlo_sharding.h: "Check failed: !UseNamedShardingLeaf() ReplicateOnLastTileDim should not be called
# for HloShardingV3"), an upstream bug; GSPMD (jax_use_shardy_partitioner=False, or the env var
# JAX_USE_SHARDY_PARTITIONER=false) compiles it and gives the same tokens. jax 0.10.2 is unaffected.
SHARDY_ABORTS_ON_JAX_011 = {("confu", "chain:3", "data=2,tensor=4")}


# (variant, plan, mesh): chain and EAGLE-2 tree for both methods; meshes that split rows over
# data (and fsdp), heads / MLP / vocab over tensor (tensor=4 > the tiny target's 2 KV heads: its
# caches and k/v projections fall back to replicated heads, query heads still split).
@pytest.mark.slow
@pytest.mark.parametrize("variant,plan,mesh", [
    ("eagle3", "chain:3", "data=2,fsdp=2,tensor=2"),
    ("eagle3", "dynamic:3,3,8", "data=4,tensor=2"),
    ("confu", "chain:3", "data=2,tensor=4"),
    ("confu", "dynamic:3,3,8", "data=2,fsdp=2,tensor=2"),
])
def test_sharded_speculative_equals_single_device(reference, variant, plan, mesh):
    _, ref = reference
    spec, _, params = make(variant, VOCAB)
    shardy_aborts = (variant, plan, mesh) in SHARDY_ABORTS_ON_JAX_011 and jax.__version_info__ >= (0, 11)
    mesh = sharded.parse_mesh(mesh)
    shardy = jax.config.jax_use_shardy_partitioner
    if shardy_aborts:
        jax.config.update("jax_use_shardy_partitioner", False)
    try:
        out = loop.generate_speculative(params.target, HeadDrafter(plans.parse_plan(plan)), params.drafter_params,
                                        prompts_for(VOCAB),
                                        max_new_tokens=N_NEW, eos_ids=(), mesh=mesh)
    finally:
        jax.config.update("jax_use_shardy_partitioner", shardy)
    assert generated_rows(out, 4) == ref
    assert np.all(np.asarray(out.stop_reason_b) == StopReason.MAX_NEW_TOKENS)
    assert np.array_equal(np.asarray(out.accept_log_bi).sum(1) + 1, np.asarray(out.n_generated_b))


# ----------------------------------------------------------------------------- Llama-3.1-8B


@pytest.fixture(scope="module")
def llama8b():
    """Shapes only: the 8B target + a ConFu head (32k draft vocabulary) on a 1×8 tensor mesh."""
    mesh = sharded.parse_mesh("data=1,tensor=8")
    spec = ModelSpec(get_preset("llama-3.1-8b"), HeadConfig(variant="confu"))
    return mesh, spec, sharded.abstract_params(spec, mesh)


def test_llama8b_per_device_parameter_bytes(llama8b):
    mesh, spec, params = llama8b
    shardings = jax.tree_util.tree_map(lambda x: x.sharding, params)
    rep = sharded.bytes_report(params, shardings)
    per_dev = rep["per_device"]
    assert sorted(per_dev) == sorted(d.id for d in mesh.devices.flat)
    # every sharded leaf divides by 8 here (32 heads, 8 KV heads, 14336 MLP, 128256 vocab)
    assert set(per_dev.values()) == {rep["sharded"] // 8 + rep["replicated"]}
    assert rep["replicated"] < 0.01 * rep["total"], rep  # norms, router, vocab maps
    t_rep = sharded.bytes_report(params[0].params, shardings[0].params)
    assert t_rep["total"] == 2 * 8_030_261_248  # Llama-3.1-8B's parameter count in bf16
    assert t_rep["max_per_device"] == t_rep["sharded"] // 8 + t_rep["replicated"]
    # the training table decides: q_proj over heads, embeddings over vocab
    specs = {shd.path_str(p): s.spec for p, s in jax.tree_util.tree_flatten_with_path(shardings)[0]}
    assert specs["0/params/layers/q_proj/kernel"] == P(None, None, "tensor")
    assert specs["0/params/embed/embedding"] == P("tensor", None)
    assert specs["1/weights/lm_head/kernel"] == P(None, "tensor")  # the head's LM head over its vocabulary


@pytest.fixture(scope="module")
def llama8b_traced(llama8b):
    """The AR and speculative (ConFu, dynamic tree) 8B programs traced with sharded inputs, scanned
    layers (the accelerator form)."""
    mesh, spec, _ = llama8b
    traced = tracing.trace_loops(spec, mesh, HeadDrafter(plans.parse_plan("dynamic:4,4,16")))
    return traced["ar"], traced["speculative"]


def test_llama8b_loops_lower_on_tensor_mesh(llama8b_traced):
    for traced in llama8b_traced:
        text = traced.lower().as_text()
        assert 'mhlo.num_partitions = 8' in text
        assert text.count('{"tensor"}') >= 7, text[:2000]  # sharded parameter and cache dims


def test_llama8b_loops_lower_for_tpu(llama8b_traced):
    for traced in llama8b_traced:
        try:
            lowered = traced.lower(lowering_platforms=("tpu",))
        except Exception as e:  # noqa: BLE001 - any refusal of this JAX to lower for TPU
            pytest.skip(f"this JAX cannot lower for TPU here: {type(e).__name__}: {e}")
        assert 'mhlo.num_partitions = 8' in lowered.as_text()


@pytest.mark.slow
def test_decode_cost_cli_reports_per_device_bytes(tmp_path):
    """``launch.decode_cost --mesh``: each device's share = sharded / n + replicated, loops lower."""
    import json
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "cost.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "launch.decode_cost", "--models=tiny", "--caches=32",
                           "--tokens=1", "--mesh=tensor=2", "--mesh_plan=chain:2", f"--out={out}"],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rep = json.loads(out.read_text())["sharded"]["tiny"]
    assert rep["mesh"] == {"data": 1, "fsdp": 1, "tensor": 2}
    assert rep["replicated_fallbacks"] == []  # tiny's 4 heads, 2 KV heads, 128 MLP, 128 vocab all split
    for label, r in rep["params"].items():
        assert r["max_per_device"] == r["min_per_device"] == r["sharded"] // 2 + r["replicated"], label
        assert r["sharded"] + r["replicated"] == r["total"]
    assert rep["params"]["target+confu"]["total"] > rep["params"]["target"]["total"]
    assert rep["lowers_ar"] is True and rep["lowers_speculative"] is True
    assert "per-device parameter bytes" in proc.stdout
