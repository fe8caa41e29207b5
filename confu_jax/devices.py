"""What the project knows of an accelerator it may compile for, and which platform a program is for.

* Peaks from vendor datasheets: HBM bandwidth and dense bf16 matmul throughput, matched on
  ``jax.Device.device_kind`` substrings (case-insensitive, most specific first) as JAX spells them —
  a v5p is "TPU v5", a v5e "TPU v5 lite", a v6e "TPU v6 lite". One table for the training log's MFU
  (``train.throughput``) and the kernel / decode benchmarks' fraction of the memory roofline
  (``bench.kernel_cost``); a device it does not list gets None ("n/a" in the logs).
* HBM per device (``device_memory_bytes``): what "does it fit?" compares a compiled program's peak with
  (``confu_jax.topology``).
* The platform programs are built for (``compile_platform``): JAX's default backend, unless a
  :func:`compiling_for` block says otherwise. Every choice a trace makes by platform (the CPU's packed
  matmul, scanned vs unrolled layers, the attention kernels a config may name) reads this, never the
  host's backend, so a program compiled on a CPU host for a TPU or an H100 is the one that device runs.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Optional

# (substring of device_kind, HBM GB/s, dense bf16 TFLOP/s); None where the datasheet gives none here
DEVICE_PEAKS = (
    ("H100 PCIe", 2000.0, 756.0),
    ("H100 NVL", 3900.0, 835.0),
    ("GH200", 4000.0, 989.0),
    ("H100", 3350.0, 989.0),  # SXM5 80GB HBM3 ("NVIDIA H100 80GB HBM3")
    ("H200", 4800.0, 989.0),
    ("A100-SXM4-80GB", 2039.0, 312.0),
    ("A100", 1555.0, 312.0),
    ("L40S", 864.0, 362.0),
    ("L4", 300.0, 121.0),
    ("TPU v6 lite", 1640.0, 918.0),  # v6e
    ("TPU v6e", 1640.0, 918.0),
    ("TPU v5 lite", 819.0, 197.0),  # v5e (before "TPU v5", which it contains)
    ("TPU v5e", 819.0, 197.0),
    ("TPU v5p", 2765.0, 459.0),
    ("TPU v5", 2765.0, 459.0),  # v5p, as JAX names it
    ("TPU v4", 1200.0, 275.0),
)

# (substring of device_kind, bytes of memory per device), matched like DEVICE_PEAKS. GPUs: the
# device_memory_size of XLA's GPU target specs (what XLA:GPU plans with; the card reports a little
# more). TPUs: HBM per chip (v5p 95 GiB, v5e 16 GiB, v6e 32 GiB). Not v4: libtpu's v4:2x2x1 has 8 devices
# on 4 chips, and which share of a chip's 32 GiB one of them plans with was not established.
DEVICE_MEMORY = (
    ("H100", 84942979072),  # "NVIDIA H100 80GB HBM3" (SXM)
    ("H200", 151397597184),  # "NVIDIA H200 141GB HBM3e"
    ("A100-SXM4-80GB", 85899345920),
    ("TPU v6 lite", 32 * 2**30),
    ("TPU v5 lite", 16 * 2**30),
    ("TPU v5e", 16 * 2**30),
    ("TPU v5p", 95 * 2**30),
    ("TPU v5", 95 * 2**30),
)


def _match(table, device_kind: str):
    kind = device_kind.lower()
    for row in table:
        if row[0].lower() in kind:
            return row[1:]
    return None


def device_peaks(device_kind: str) -> tuple[Optional[float], Optional[float]]:
    """(peak HBM GB/s, peak dense bf16 TFLOP/s) for a JAX ``device_kind`` string, or (None, None)."""
    return _match(DEVICE_PEAKS, device_kind) or (None, None)


def device_memory_bytes(device_kind: str) -> Optional[int]:
    """Memory per device of a JAX ``device_kind``, or None where the table has no entry."""
    row = _match(DEVICE_MEMORY, device_kind)
    return None if row is None else int(row[0])


# ----------------------------------------------------------------------------- the platform compiled for

_COMPILE_PLATFORM: contextvars.ContextVar = contextvars.ContextVar("confu_jax_compile_platform", default=None)
_PLATFORM_NAMES = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu", "cpu": "cpu"}


def platform_name(platform: str) -> str:
    """A device's or backend's platform as the trace-time choices read it: 'cpu', 'gpu' or 'tpu'."""
    try:
        return _PLATFORM_NAMES[str(platform).lower()]
    except KeyError:
        raise ValueError(f"unknown platform {platform!r}; expected one of {sorted(_PLATFORM_NAMES)}") from None


def compile_platform() -> str:
    """The platform the programs traced now are for: the innermost :func:`compiling_for`, else JAX's
    default backend (the host's devices, which run what is compiled without a topology)."""
    p = _COMPILE_PLATFORM.get()
    if p is not None:
        return p
    import jax

    return platform_name(jax.default_backend())


def mesh_platform(mesh) -> str:
    """The platform of a mesh's devices (a topology's, when compiling for hardware not attached)."""
    return platform_name(next(iter(mesh.devices.flat)).platform)


@contextlib.contextmanager
def compiling_for(platform: Optional[str]):
    """Trace (and lower) for ``platform`` ('cpu', 'gpu' / 'cuda', 'tpu'; None: no change) whatever the
    host is: ``with compiling_for('tpu'): jax.jit(f).lower(*abstract_args_on_tpu_devices).compile()``."""
    if platform is None:
        yield
        return
    token = _COMPILE_PLATFORM.set(platform_name(platform))
    try:
        yield
    finally:
        _COMPILE_PLATFORM.reset(token)
