"""Mesh construction and the logical-axis rules (8 fake CPU devices from conftest)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from confu_jax import sharding as shd
from confu_jax.models.llama import param_shapes
from confu_jax.models.presets import get_preset


def test_make_mesh_fill_and_order():
    mesh = shd.make_mesh(-1, 2, 2)
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    # process-major device order: the mesh is jax.devices() reshaped, 'data' outermost
    assert [d.id for d in mesh.devices.reshape(-1)] == [d.id for d in jax.devices()]
    assert dict(shd.make_mesh(1, -1, 1).shape)["fsdp"] == 8


@pytest.mark.parametrize("sizes,msg", [((-1, -1, 1), "at most one"), ((3, -1, 1), "not divisible"),
                                       ((2, 2, 1), "need 4 devices, found 8"),
                                       ((0, 1, 1), "positive")])
def test_make_mesh_errors(sizes, msg):
    with pytest.raises(ValueError, match=msg):
        shd.make_mesh(*sizes)


def test_llama_param_specs():
    cfg = get_preset("tiny")
    mesh = shd.make_mesh(2, 2, 2)
    rows = {r["path"]: r for r in shd.explain(param_shapes(cfg), mesh,
                                              axis_units=shd.llama_axis_units(cfg.head_dim))}
    expect = {
        "embed/embedding": P("tensor", "fsdp"),
        "layers/q_proj/kernel": P(None, "fsdp", "tensor"),  # leading scan axis replicated
        "layers/k_proj/kernel": P(None, "fsdp", "tensor"),
        "layers/o_proj/kernel": P(None, "tensor", "fsdp"),
        "layers/gate_proj/kernel": P(None, "fsdp", "tensor"),
        "layers/down_proj/kernel": P(None, "tensor", "fsdp"),
        "layers/attn_norm/scale": P(None, None),
        "final_norm/scale": P(None),
    }
    for path, spec in expect.items():
        assert rows[path]["spec"] == spec, (path, rows[path])
        assert not rows[path]["fallbacks"]


def test_smollm2_nine_heads_fall_back_to_replication():
    """9 query / 3 KV heads on tensor=2: the head dims are replicated (not split mid-head),
    everything divisible stays sharded. Shapes only (eval_shape), nothing allocated."""
    cfg = get_preset("smollm2-135m")
    mesh = shd.make_mesh(2, 2, 2)
    rows = {r["path"]: r for r in shd.explain(param_shapes(cfg), mesh,
                                              axis_units=shd.llama_axis_units(cfg.head_dim))}
    q = rows["layers/q_proj/kernel"]
    assert q["shape"] == (30, 576, 576)  # 576 = 9 × 64 is even, but 9 heads are not
    assert q["spec"] == P(None, "fsdp", None)
    assert [(d, name) for d, name, _, _ in q["fallbacks"]] == [(2, "heads")]
    assert rows["layers/k_proj/kernel"]["spec"] == P(None, "fsdp", None)
    assert rows["layers/gate_proj/kernel"]["spec"] == P(None, "fsdp", "tensor")  # 1536 / 2
    assert rows["embed/embedding"]["spec"] == P("tensor", "fsdp")  # 49152 / 2, 576 / 2
    # and every sharding is constructible and valid for its shape
    shards = shd.tree_shardings(param_shapes(cfg), mesh,
                                axis_units=shd.llama_axis_units(cfg.head_dim))
    for leaf, s in zip(jax.tree_util.tree_leaves(param_shapes(cfg)), jax.tree_util.tree_leaves(shards)):
        s.shard_shape(leaf.shape)  # raises if not divisible


def test_spec_uses_each_mesh_axis_once():
    mesh = shd.make_mesh(2, 2, 2)
    # both dims want 'fsdp' (via 'batch' and 'embed'): only the first gets it
    spec, _ = shd.spec_for((8, 64), ("batch", "embed"), mesh)
    assert spec == P(("data", "fsdp"), None)
    # axes of size 1 are dropped rather than written into the spec
    spec, _ = shd.spec_for((8, 64), ("batch", "embed"), shd.make_mesh(8, 1, 1))
    assert spec == P("data", None)


def test_optimizer_state_mirrors_param_shardings():
    import optax

    mesh = shd.make_mesh(2, 2, 2)
    params = {"fc": {"kernel": jnp.zeros((192, 64))}, "norm": {"scale": jnp.ones(64)}}
    opt = jax.eval_shape(optax.adamw(1e-3).init, params)
    sh = shd.tree_shardings({"params": params, "opt": opt}, mesh)
    assert sh["params"]["fc"]["kernel"].spec == P("fsdp", "tensor")
    assert sh["opt"][0].mu["fc"]["kernel"].spec == P("fsdp", "tensor")
    assert sh["opt"][0].nu["fc"]["kernel"].spec == P("fsdp", "tensor")
    assert sh["opt"][0].count.spec == P()


def test_global_batch_and_put_tree_roundtrip():
    mesh = shd.make_mesh(2, 2, 2)
    x = np.arange(8 * 5, dtype=np.int32).reshape(8, 5)
    g = shd.global_batch({"tokens": x}, mesh)["tokens"]
    assert g.sharding.spec == P(("data", "fsdp"), None)
    np.testing.assert_array_equal(np.asarray(g), x)
    # each of the 4 batch shards holds 2 contiguous rows
    rows = sorted({(s.index[0].start, s.index[0].stop) for s in g.addressable_shards})
    assert rows == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="not divisible by the batch mesh axes"):
        shd.global_batch({"tokens": x[:6]}, mesh)
    w = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)
    placed = shd.put_tree({"w": w}, {"w": NamedSharding(mesh, P("fsdp", "tensor"))})
    np.testing.assert_array_equal(np.asarray(placed["w"]), w)
    assert placed["w"].sharding.spec == P("fsdp", "tensor")


def test_constrain_is_noop_outside_and_pins_layout_inside():
    mesh = shd.make_mesh(2, 2, 2)
    x = jnp.ones((8, 4, 16))
    assert shd.constrain(x, ("batch", None, None)) is x
    f = jax.jit(lambda a: shd.constrain(a * 2, ("batch", None, "mlp")))
    with shd.activation_mesh(mesh):
        out = f(x)
    assert out.sharding.spec == P(("data", "fsdp"), None, "tensor")
    np.testing.assert_array_equal(np.asarray(out), 2 * np.ones((8, 4, 16)))


@pytest.mark.parametrize("config_name", ["smollm2_confu", "smollm2_eagle3", "llama32_3b_confu",
                                         "llama31_8b_confu"])
def test_every_shipped_model_shards_on_every_mesh(config_name):
    """Target and trainable ConFu / EAGLE-3 trees of the shipped configs: every leaf gets a valid
    sharding on meshes of all shapes (odd head counts fall back, nothing raises). Shapes only."""
    import importlib

    from confu_jax.models.params import trainable_shapes
    from confu_jax.models.spec import model_spec_from_config

    config = importlib.import_module(f"configs.{config_name}").get_config()
    cfg = get_preset(config.model.preset)
    units = shd.llama_axis_units(cfg.head_dim)
    trees = {"target": param_shapes(cfg), "trainable": trainable_shapes(model_spec_from_config(config))}
    for shape in [(2, 2, 2), (1, 8, 1), (1, 1, 8), (1, 2, 4)]:
        mesh = shd.make_mesh(*shape)
        for name, tree in trees.items():
            shards = shd.tree_shardings(tree, mesh, axis_units=units)
            for leaf, s in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(shards)):
                s.shard_shape(leaf.shape)
    rows = {r["path"]: r["spec"] for r in shd.explain(trees["trainable"], shd.make_mesh(2, 2, 2),
                                                      axis_units=units)}
    assert rows["draft/fc/kernel"] == P("fsdp", "tensor")  # [3d, d]
    if config.confu.variant == "confu":
        assert rows["confu/moe_con/experts_ed"] == P(None, "fsdp")


def test_constrain_pins_named_dims_and_leaves_free_ones_to_xla():
    """``constrain(x, ('batch', FREE))``: the batch dim sharded over the data axes, the other dim left to
    XLA's propagation (an open dim in the lowered sharding), where None would replicate it."""
    import jax
    import jax.numpy as jnp

    from confu_jax import sharding as shd

    mesh = shd.make_mesh(1, 4, 2, devices=jax.devices()[:8])
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    with shd.activation_mesh(mesh):
        free = jax.jit(lambda a: shd.constrain(a, ("batch", shd.FREE))).trace(x).lower().as_text()
        pinned = jax.jit(lambda a: shd.constrain(a, ("batch", None))).trace(x).lower().as_text()
    # Shardy's text: {?} an open dim (XLA decides), {} a closed one (replicated)
    assert '[{"fsdp"}, {?}]' in free and '[{"fsdp"}, {}]' in pinned, (free, pinned)
    assert shd.constrain(jnp.ones((2, 3)), ("batch", shd.FREE)).shape == (2, 3)  # a no-op outside a mesh
