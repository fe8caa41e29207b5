"""Few-row float32 matmuls for CPU decoding: a verification pass that reads each weight once.

Why: XLA:CPU's dot kernels (YNNPACK / Eigen in the pinned jaxlib) make a 4-row product against a
[576, 1536] weight cost ~2.3x a 1-row product on two cores, so a chain:3 pass (4 rows) cost ~1.7
AR steps although it reads the same bytes (docs/RESULTS.md, "A pass that reads each weight once"). This
module packs a ``[in, out]`` kernel once per target into 64-column panels ``[P, in, 64]`` and
multiplies through an XLA FFI handler (``cpu_matmul.cc``) that streams each panel once with all
rows' accumulators in registers and prefetches ahead: 4 rows cost ~1.15x one row.

Values: every output is one fused multiply-add chain over ``in`` ascending, whatever the number of
rows, so a row of a T-row verification equals the same row decoded alone, bit for bit (the AR
step and the verification pass of a lossless loop agree exactly, not to a tolerance). Against
XLA's own dot the results agree to float32 rounding.

Scope: the layer-unrolled CPU decode path only (``models.unrolled.split_layers(pack=True)``), float32,
one device (the handler is not partitioned). Prefill runs through it too: rows go in groups of 8
through each panel while the panel is in cache, near the FMA peak. Never differentiated: training keeps the stacked
``[in, out]`` layout. The handler is compiled on first use with the host's C++ compiler
(``-O3 -march=native``, cached under ``~/.cache/confu_jax/kernels``); without a compiler, or with
``CONFU_JAX_CPU_MATMUL=off``, :func:`available` is False and the loop keeps XLA's dots.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

PANEL = 64  # columns per packed panel (cpu_matmul.cc PANEL)
TARGET = "confu_packed_matmul_f32"
_SOURCE = pathlib.Path(__file__).with_name("cpu_matmul.cc")


def _cache_dir() -> pathlib.Path:
    base = os.environ.get("CONFU_JAX_KERNEL_CACHE") or os.path.join("~", ".cache", "confu_jax", "kernels")
    return pathlib.Path(base).expanduser()


def _compile() -> pathlib.Path:
    """Build the handler once per (source, jaxlib, instruction set, compiler): written to a temporary
    name and renamed, so concurrent test workers never load a half-written library; its sha256 is
    written beside it and checked before every load (a changed or truncated library is rebuilt,
    never loaded)."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not cxx:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++) on PATH")
    include = jax.ffi.include_dir()
    flags = ["-O3", "-march=native", "-ffp-contract=fast", "-std=c++17", "-shared", "-fPIC", "-w"]
    key = hashlib.sha256(b"\0".join([_SOURCE.read_bytes(), jax.__version__.encode(), " ".join(flags).encode(),
                                     cxx.encode(), os.uname().machine.encode(), isa_id(cxx)])).hexdigest()[:16]
    out = _cache_dir() / f"cpu_matmul_{key}.so"
    digest = out.with_suffix(".so.sha256")
    if out.exists() and digest.exists() and digest.read_text().strip() == _sha256(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cxx, *flags, f"-I{include}", str(_SOURCE), "-o", tmp], check=True, capture_output=True,
                       text=True, timeout=300)
        fd, tmp_digest = tempfile.mkstemp(suffix=".sha256", dir=out.parent)
        with os.fdopen(fd, "w") as f:
            f.write(_sha256(pathlib.Path(tmp)) + "\n")
        os.replace(tmp, out)
        os.replace(tmp_digest, digest)  # after the library: a digest never names a library not yet there
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"{cxx} failed on {_SOURCE.name}: {e.stderr.strip()[-2000:]}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@functools.lru_cache(maxsize=None)
def isa_id(cxx: str) -> bytes:
    """What ``-march=native`` means on this host, as the compiler itself resolves it: its predefined
    macros under ``-march=native`` (``__AVX512F__``, ``__ARM_FEATURE_SVE``, the target's name...). The
    same on every OS and architecture the compiler runs on — ``/proc/cpuinfo``'s fields, the former key,
    are Linux/x86 only (aarch64 has no ``model name``, macOS no file), so two ARM hosts sharing a home
    could share a library one of them cannot execute (SIGILL, uncatchable)."""
    p = subprocess.run([cxx, "-march=native", "-dM", "-E", "-x", "c++", os.devnull], capture_output=True,
                       timeout=120)
    if p.returncode != 0:
        raise RuntimeError(f"{cxx} -march=native -dM -E failed: {p.stderr.decode(errors='replace').strip()[-500:]}")
    return b"\n".join(sorted(set(p.stdout.splitlines())))


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """The handler is built and registered for the CPU backend (False: keep XLA's dots)."""
    if os.environ.get("CONFU_JAX_CPU_MATMUL", "").lower() in ("0", "off", "false", "no"):
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(str(_compile()))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.ConfuPackedMatmulF32), platform="cpu")
        return True
    except Exception as e:  # noqa: BLE001  (any failure means: decode with XLA's dots)
        print(f"confu_jax: CPU few-row matmul unavailable ({e}); decoding with XLA's dot kernels",
              file=sys.stderr)
        return False


def use_packed(cfg) -> bool:
    """Whether the unrolled CPU decode path packs this target's kernels: compiling for the CPU
    (``devices.compile_platform``: not the host's backend, so a TPU or GPU program compiled here
    never holds the CPU-only custom call), float32 weights and compute, handler available."""
    from confu_jax.devices import compile_platform

    return (compile_platform() == "cpu" and jnp.dtype(cfg.dtype) == jnp.float32
            and jnp.dtype(cfg.param_dtype) == jnp.float32 and available())


def pack(w_io: jax.Array) -> jax.Array:
    """``[in, out]`` -> ``[ceil(out / 64), in, 64]`` panels (zero columns pad the last panel)."""
    i, o = w_io.shape
    p = -(-o // PANEL)
    w = jnp.pad(w_io.astype(jnp.float32), ((0, 0), (0, p * PANEL - o)))
    return w.reshape(i, p, PANEL).transpose(1, 0, 2)


def is_packed(w) -> bool:
    return getattr(w, "ndim", 0) == 3 and w.shape[-1] == PANEL


def packed_matmul(x: jax.Array, w_pip: jax.Array, features: int) -> jax.Array:
    """``x @ W`` (float32) for ``W`` packed by :func:`pack` with ``features`` output columns; any
    leading dimensions on ``x``."""
    lead, i = x.shape[:-1], x.shape[-1]
    p = w_pip.shape[0]
    if w_pip.shape[1] != i or p * PANEL < features:
        raise ValueError(f"packed weight {w_pip.shape} does not fit x {x.shape} -> {features} features")
    if not available():  # also registers the handler (a packed tree may come from elsewhere)
        raise RuntimeError("a packed kernel needs the CPU few-row matmul handler, which is unavailable here "
                           "(see the message above, or CONFU_JAX_CPU_MATMUL)")
    x2 = x.reshape(-1, i).astype(jnp.float32)
    y = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x2.shape[0], p * PANEL), jnp.float32))(x2, w_pip)
    return y[:, :features].reshape(*lead, features)
