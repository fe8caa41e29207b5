"""The compile lane, part 4: the Pallas tree-attention kernel compiled for an H100 (sm_90a) by XLA:GPU
from this CPU host at every shipped plan's verification shapes (``bench.kernel_cost.shipped_kernel_calls``:
chain:3 / chain:4 / dynamic:6,8,30 / dynamic:6,10,60, EAGLE-3 and ConFu blocks, the shipped presets'
heads, bf16 and SmolLM2's float32), with ptxas' own register and spill counts: no kernel spills. A
spill is local memory traffic inside the key loop — the kernel's reason to exist is to read the cache
once at HBM speed. The check has teeth: a tiling of two 128-row sub-tiles per group, the old default,
spills."""

from __future__ import annotations

import pytest

from confu_jax.topology import use_compilers  # noqa: E402

use_compilers()  # .xla-compilers (README command 2) on the path
pytest.importorskip("jax_plugins.xla_cuda12", reason="the GPU compiler (requirements-compilers.txt in .xla-compilers)")

from confu_jax import topology as tp  # noqa: E402
from confu_jax.bench.kernel_cost import kernel_registers, shipped_kernel_calls  # noqa: E402

pytestmark = pytest.mark.slow
if tp.ptxas_path() is None:  # pragma: no cover - the nvcc wheel is in requirements-compilers.txt
    pytest.skip("no ptxas (requirements-compilers.txt)", allow_module_level=True)

CALLS = shipped_kernel_calls()


def test_the_shipped_calls_cover_every_model_head_and_plan_kind():
    assert {c["head"] for c in CALLS} == {"eagle3", "confu"}
    assert {c["d"] for c in CALLS} == {64, 128} and {c["dtype"] for c in CALLS} == {"bfloat16", "float32"}
    assert max(c["queries"] for c in CALLS) == 122  # ConFu at the paper's largest budget (T = 60 + root)


@pytest.mark.parametrize("call", CALLS, ids=lambda c: f"{c['model']}-{c['head']}-{c['plan']}-{c['dtype']}")
def test_the_kernel_spills_no_register_at_a_shipped_plan(call):
    r = kernel_registers(call, "h100:1")
    assert 0 < r["registers"] <= 255
    assert (r["spill_stores"], r["spill_loads"]) == (0, 0), r


def test_two_sub_tiles_per_group_spill_so_the_check_sees_spills():
    """Llama-3.1-8B ConFu at dynamic:6,8,30 (62 queries, 248 rows per KV head) with both 128-row
    sub-tiles in one group, 8 warps: the register file cannot hold both states (255 registers)."""
    call = next(c for c in shipped_kernel_calls(models=("llama-3.1-8b",), plans=("dynamic:6,8,30",))
                if c["head"] == "confu")
    r = kernel_registers(call, "h100:1", block_m=128, group_rows=256, num_warps=8)
    assert (r["group_rows"], r["row_groups"]) == (256, 1)
    assert r["registers"] == 255 and r["spill_stores"] > 0
