"""Accelerator peaks from vendor datasheets: HBM bandwidth and dense bf16 matmul throughput, matched on
``jax.Device.device_kind`` substrings (case-insensitive, most specific first). One table for the
training log's MFU (``train.throughput``) and the kernel / decode benchmarks' fraction of the memory
roofline (``bench.kernel_cost``); a device it does not list gets None ("n/a" in the logs).
"""

from __future__ import annotations

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
    ("TPU v5p", 2765.0, 459.0),
    ("TPU v5 lite", 819.0, 197.0),  # v5e
    ("TPU v5e", 819.0, 197.0),
    ("TPU v4", 1200.0, 275.0),
)


def device_peaks(device_kind: str) -> tuple[Optional[float], Optional[float]]:
    """(peak HBM GB/s, peak dense bf16 TFLOP/s) for a JAX ``device_kind`` string, or (None, None)."""
    kind = device_kind.lower()
    for key, gbs, tflops in DEVICE_PEAKS:
        if key.lower() in kind:
            return gbs, tflops
    return None, None
