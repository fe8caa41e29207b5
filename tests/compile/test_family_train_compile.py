"""The compile lane, part 3: every family's train step (its record's tiny config) compiled for a TPU
(v5e, fsdp over 4 chips) and an H100 by their own compilers from this CPU host
(``train.loop.compile_report(topology=...)``, what ``launch.train --compile_only --topology`` runs), in
bf16 as those chips train; the report says where it was compiled and that it fits."""

from __future__ import annotations

import pytest

from confu_jax.topology import use_compilers  # noqa: E402

use_compilers()  # .xla-compilers (README command 2) on the path
pytest.importorskip("libtpu", reason="the TPU compiler (requirements-compilers.txt in .xla-compilers)")
pytest.importorskip("jax_plugins.xla_cuda12", reason="the GPU compiler (requirements-compilers.txt in .xla-compilers)")

from confu_jax import sharding as shd  # noqa: E402
from confu_jax import topology as tp  # noqa: E402
from confu_jax import catalog  # noqa: E402
from confu_jax.train.loop import compile_report  # noqa: E402
from confu_jax.train.task import resolve_run_config  # noqa: E402
from tests.helpers.train_resume import tiny_run_config  # noqa: E402

pytestmark = pytest.mark.slow
CONFIGS = sorted({e.tiny_config for e in catalog.training()} | {"configs/tiny.py:confu"})
TOPOLOGIES = {"tpu": ("v5e:2x2", (1, 4, 1)), "gpu": ("h100:1", (1, 1, 1))}


@pytest.mark.parametrize("platform", sorted(TOPOLOGIES))
@pytest.mark.parametrize("config_file", CONFIGS)
def test_every_family_train_step_compiles_for_tpu_and_h100(config_file, platform):
    name, (data, fsdp, tensor) = TOPOLOGIES[platform]
    topo = tp.get_topology(name)
    config = tiny_run_config(config_file)
    with config.unlocked():
        config.model.dtype = "bfloat16"
        config.train.mesh.data, config.train.mesh.fsdp, config.train.mesh.tensor = data, fsdp, tensor
        config.data.global_batch_size = 4
    mesh = shd.make_mesh(data, fsdp, tensor, devices=topo.devices[:data * fsdp * tensor])
    config = resolve_run_config(config, mesh)
    r = compile_report(config, mesh=mesh, topology=topo)
    assert (r["platform"], r["device_kind"], r["devices"]) == (platform, topo.device_kind, data * fsdp * tensor)
    assert r["fits"] is True and 0 < r["per_device_peak_bytes"] < topo.device_memory_bytes
    assert r["matmul_flops_per_step"] > 0 and r["batch"]["tokens"][0] == 4


def test_a_chip_holds_its_own_rows_logits_not_the_global_batchs():
    """Weak scaling of the whole-vocabulary families' step: 8 rows over 8 H100s (FSDP) need no more
    temporaries a chip than 1 row on one. Before the target's embedding and LM head pinned their
    activations to batch-sharded rows (``models.llama``), XLA gathered every row onto every chip where
    the FSDP-sharded tables met them: MTP at Llama-3.1-8B shapes held f32[32768, 128256] logits a chip
    (59 GiB at 8 rows of 4096; 21 GiB pinned). SmolLM2's shapes, rows of 512 (logits 0.1 GB a row)."""
    import runpy

    def temp_bytes(gpus, batch):
        topo = tp.get_topology(f"h100:{gpus}")
        config = runpy.run_path("configs/smollm2_mtp.py")["get_config"]()
        with config.unlocked():
            config.model.source, config.model.preset, config.model.dtype = "abstract", "smollm2-135m", "bfloat16"
            config.data.max_length, config.data.global_batch_size, config.data.pack = 512, batch, False
            config.train.mesh.data, config.train.mesh.fsdp, config.train.mesh.tensor = 1, gpus, 1
        mesh = shd.make_mesh(1, gpus, 1, devices=topo.devices)
        r = compile_report(resolve_run_config(config, mesh), mesh=mesh, topology=topo)
        return r["memory_per_device"]["temp"]

    one, eight = temp_bytes(1, 1), temp_bytes(8, 8)
    assert eight < 1.5 * one, (eight / 2**20, one / 2**20)
