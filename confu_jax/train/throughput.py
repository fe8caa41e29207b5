"""Throughput you can see: tokens/s, real tokens/s and model-FLOPs utilisation of the training step.

FLOPs: the matrix products of the step's jaxpr, 2·M·N·K per ``dot_general``, with every ``scan``
body multiplied by its length (the target's stacked layers, the attention's key blocks, the loss's
vocabulary chunks) and rematerialised forwards counted where they run. Not XLA's
``cost_analysis()``: XLA counts a while loop's body once (a scan of 10 matmuls reports the FLOPs of
one), which would make a scanned 32-layer target look 32x cheaper. Element-wise work is left out, as
MFU conventionally does; the count is checked against XLA's on a loop-free program
(tests/e2e/test_throughput.py).

Peak: dense bf16 FLOP/s of one device from ``confu_jax.devices`` by ``device_kind``; unknown devices
(CPUs included) report MFU as "n/a" rather than a guess.
"""

from __future__ import annotations

import math
import time
from typing import Optional

import jax

from confu_jax.devices import device_peaks

def device_peak_flops(device=None) -> Optional[float]:
    """Dense bf16 FLOP/s of ``device`` (default: the first), or None where ``confu_jax.devices`` has no entry."""
    _, tflops = device_peaks(str(getattr(device or jax.devices()[0], "device_kind", "")))
    return None if tflops is None else tflops * 1e12


def _dot_flops(eqn) -> float:
    (lc, rc), (lb, _) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    batch = math.prod(lhs[i] for i in lb)
    contract = math.prod(lhs[i] for i in lc)
    m = math.prod(d for i, d in enumerate(lhs) if i not in lc and i not in lb)
    n = math.prod(d for i, d in enumerate(rhs) if i not in rc and i not in eqn.params["dimension_numbers"][1][1])
    return 2.0 * batch * m * n * contract


def jaxpr_matmul_flops(jaxpr) -> float:
    """2·M·N·K over every ``dot_general`` of a (closed) jaxpr, scans multiplied by their length,
    conditionals by their most expensive branch, while loops (unknown trip count) once."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            total += _dot_flops(eqn)
            continue
        if name == "cond":
            total += max(jaxpr_matmul_flops(b) for b in eqn.params["branches"])
            continue
        inner = [v for v in eqn.params.values() if hasattr(v, "eqns") or hasattr(v, "jaxpr")]
        inner += [j for v in eqn.params.values() if isinstance(v, (tuple, list))
                  for j in v if hasattr(j, "eqns") or hasattr(j, "jaxpr")]
        sub = sum(jaxpr_matmul_flops(j) for j in inner)
        total += sub * (int(eqn.params["length"]) if name == "scan" else 1)
    return total


def matmul_flops(fn, *args) -> float:
    """Matrix-product FLOPs of one call of ``fn(*args)`` (arrays or ShapeDtypeStructs), traced, not run."""
    return jaxpr_matmul_flops(jax.make_jaxpr(fn)(*args))


class Meter:
    """Wall time between log points -> tokens/s, real tokens/s and MFU over the interval.

    ``tokens_per_step``: the global batch's positions (rows x row length); real tokens come from the
    step's ``tokens/real`` metric (non-padding positions, summed over the global batch in the step).
    ``flops_per_step``: the whole step on all devices; ``peak``: one device's FLOP/s (None: n/a)."""

    def __init__(self, tokens_per_step: int, flops_per_step: Optional[float], peak: Optional[float],
                 n_devices: int):
        self.tokens_per_step, self.flops, self.peak, self.n_devices = tokens_per_step, flops_per_step, peak, n_devices
        self.t0: Optional[float] = None
        self.steps = 0
        self.real = 0.0

    def start(self):
        """Begin an interval (after the first, compiling step has finished)."""
        self.t0, self.steps, self.real = time.perf_counter(), 0, 0.0

    def step(self, real_tokens: Optional[float] = None):
        self.steps += 1
        if real_tokens is not None:
            self.real += real_tokens

    def read(self) -> dict:
        """The interval's figures (an empty dict before ``start`` or with no step), and a new interval."""
        if self.t0 is None or self.steps == 0:
            return {}
        dt = max(time.perf_counter() - self.t0, 1e-9)
        out = {"throughput/step_s": dt / self.steps,
               "throughput/tokens_per_s": self.tokens_per_step * self.steps / dt}
        real = float(jax.device_get(self.real))  # device scalars added up step by step: one sync here
        if real:
            out["throughput/real_tokens_per_s"] = real / dt
        if self.flops and self.peak:
            out["throughput/mfu"] = self.flops * self.steps / dt / (self.peak * self.n_devices)
        self.start()
        return out

    def describe(self, figures: dict) -> str:
        if not figures:
            return ""
        mfu = figures.get("throughput/mfu")
        why = "n/a (no peak FLOP/s for this device kind)" if self.peak is None else "n/a"
        real = figures.get("throughput/real_tokens_per_s")
        return (f"{figures['throughput/step_s']:.3f} s/step, {figures['throughput/tokens_per_s']:,.0f} tokens/s"
                + (f" ({real:,.0f} real)" if real is not None else "")
                + f", MFU {f'{100 * mfu:.1f}%' if mfu is not None else why}"
                + (f", {self.flops / 1e12:.2f} TFLOP/step" if self.flops else ""))


def parse_profile_steps(text: str) -> Optional[tuple]:
    """``train.profile_steps`` 'A:B' -> (A, B): trace steps A..B (1-based, inclusive); '' -> None."""
    text = str(text or "").strip()
    if not text:
        return None
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"train.profile_steps: expected 'A:B' (first and last step to trace), got {text!r}") from None
    if not 1 <= a <= b:
        raise ValueError(f"train.profile_steps: expected 1 <= A <= B, got {text!r}")
    return a, b

