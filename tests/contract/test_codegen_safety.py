"""Regression check for an XLA:CPU code-generation abort that once killed this suite on AVX-512 hosts.

jaxlib 0.10.2's LLVM at -O1 (``--xla_backend_optimization_level=1``), generating AVX-512 code, aborts
the process (``LLVM ERROR: Cannot select: ... v8i32 = X86ISD::SUBV_BROADCAST_LOAD`` in
``compare_and_fusion``) on the small integer fusion below: a per-row index broadcast along a row,
a select, and two compares fused into one loop. It is the shape of the lookup drafter's acceptance
check (where it was found, in the loop program of ``test_lookup.py::test_greedy_equals_ar``). The
suite's flags (``tests/helpers/xla_env.py``) cap code generation at AVX2 for that reason.

Each case compiles the program in a fresh subprocess, so an abort fails this test with LLVM's
message instead of killing a pytest worker, and checks the values against numpy. It runs on every
host: on an AVX2-only host the cap changes nothing and the program compiles either way; on an
AVX-512 host it is the cap that makes it pass.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers.xla_env import CODEGEN, EIGHT_DEVICES, SINGLE_DEVICE

_TRIGGER = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np

def accept(token, proposed, drafted, last):
    # last[b]: index of row b's last drafted slot; proposed[b]: the token placed there.
    iota = jax.lax.broadcasted_iota(jnp.int32, drafted.shape, 1)
    placed = jnp.where(iota == last[:, None], proposed[:, None], drafted)
    return (placed == token) & (iota < (last + 1)[:, None])

args = json.loads(sys.argv[1])
out = jax.jit(accept)(np.int32(args["token"]), np.asarray(args["proposed"], np.int32),
                      np.asarray(args["drafted"], np.int32), np.asarray(args["last"], np.int32))
print(json.dumps(np.asarray(out).astype(int).tolist()))
"""

_ARGS = {"token": 3, "proposed": [3, 3], "drafted": [[0, 1, 2, 3, 0], [1, 2, 3, 0, 1]], "last": [2, 3]}


def _reference(a):
    drafted = np.asarray(a["drafted"])
    iota = np.arange(drafted.shape[1])[None, :]
    last = np.asarray(a["last"])[:, None]
    placed = np.where(iota == last, np.asarray(a["proposed"])[:, None], drafted)
    return ((placed == a["token"]) & (iota < last + 1)).astype(int).tolist()


@pytest.mark.parametrize(
    "flags",
    [EIGHT_DEVICES, SINGLE_DEVICE, ""],
    ids=["suite-eight-devices", "suite-cli-subprocess", "product-default"],
)
def test_trigger_compiles_and_computes(flags):
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # compile it here, never load it from the run's cache
    proc = subprocess.run(
        [sys.executable, "-c", _TRIGGER, json.dumps(_ARGS)], env=env, capture_output=True, text=True, timeout=300
    )
    llvm = [line for line in proc.stderr.splitlines() if "LLVM ERROR" in line]
    assert proc.returncode == 0, f"XLA_FLAGS={flags!r}: exit {proc.returncode}; {llvm or proc.stderr[-2000:]}"
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == _reference(_ARGS)
    # Not a trivial reference: the select, both compares and the row broadcast each decide an entry.
    assert _reference(_ARGS) == [[0, 0, 1, 0, 0], [0, 0, 1, 1, 0]]


def test_o1_only_with_the_avx2_cap():
    """LLVM -O1 is proven safe in this suite only with code generation capped at AVX2 (the module
    docstring says why): whoever changes the level keeps the cap, or drops -O1 with it."""
    flags = CODEGEN.split()
    if "--xla_backend_optimization_level=1" in flags:
        assert "--xla_cpu_max_isa=AVX2" in flags, CODEGEN
    assert EIGHT_DEVICES.endswith(CODEGEN) and SINGLE_DEVICE == CODEGEN
