"""Hardware that is not attached, as the real compilers see it: "will it fit?" asked of XLA:TPU and
XLA:GPU from any machine (docs/scale.md "Does it fit?").

``get_topology('v5p:2x2x2')`` (any TPU topology as JAX names it: ``v5e:2x4``, ``v6e:2x2``, ``v4:2x2x1``)
or ``get_topology('h100:8')`` / ``'h200:1'`` (N GPUs of one node) gives compile-only devices: a mesh
over them, inputs as ``jax.ShapeDtypeStruct``\\ s with shardings on that mesh, then
``jit(f).lower(...).compile()`` runs the TPU or GPU compiler on this host and
``compiled.memory_analysis()`` says what one device holds. Needs the compilers (README "Accelerator
compilers"): libtpu for TPUs; the CUDA plugin and a ptxas (the ``nvidia-cuda-nvcc-cu12`` wheel's, found
here) for GPUs. Trace-time choices follow the topology's platform, not the host's
(``devices.compiling_for``): no CPU custom call reaches a TPU program.

GPU targets: a ``GpuTargetConfigProto`` per GPU named, written from XLA's own device specs
(openxla/xla ``xla/backends/gpu/target_config/specs/h100_sxm.txtpb``, ``h200.txtpb``: the fields the
compiler plans with; the per-unit rate tables, which feed only its cost model, are left out, and so is
``collective_memory_granularity``, which jaxlib 0.10.2's proto does not have).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Optional

from confu_jax.devices import device_memory_bytes, platform_name

TPU_TOPOLOGY = re.compile(r"^v(\d+)([a-z]*):(\d+(x\d+)*)$")
GPU_TOPOLOGY = re.compile(r"^(h100|h200):(\d+)$")

# name -> (device_kind, device_memory_size, memory_bandwidth B/s, mem clock kHz) from XLA's specs
_GPUS = {
    "h100": ("NVIDIA H100 80GB HBM3", 84942979072, 3352320000000, 2619000),
    "h200": ("NVIDIA H200 141GB HBM3e", 151397597184, 4800000000000, 3750000),
}


def gpu_target_config(gpu: str) -> str:
    """The text ``GpuTargetConfigProto`` of an ``h100`` (SXM) or ``h200``: sm_90a, 132 SMs, its memory."""
    kind, mem, bw, mem_khz = _GPUS[gpu]
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bw}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {mem}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{
    major: 9
    feature_extension: ACCELERATED_FEATURES
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  device_vendor: "NVIDIA Corporation"
  platform_version: "Compute Capability 9.0a"
  model_str: "sm_9.0a with {mem}B RAM, 132 cores, 1980000KHz clock, {mem_khz}KHz mem clock, 52428800B L2$"
  device_address_bits: 64
  pcie_bandwidth: 34359738368
  ecc_enabled: true
  name: "{kind}"
  driver_version: "13.0.0"
  runtime_version: "12.8.0"
  compile_time_toolkit_version: "12.8.0"
  dnn_version: "9.10.0"
  device_interconnect_info {{
    active_links: 18
  }}
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 10
  patch: 0
}}
device_description_str: "{kind}"
"""


@dataclasses.dataclass(frozen=True)
class Topology:
    """Compile-only devices of a named topology (``get_topology``)."""

    name: str  # as the user wrote it: 'v5p:2x2x2', 'h100:8'
    platform: str  # 'tpu' | 'gpu'
    devices: tuple
    device_kind: str  # as JAX names it: 'TPU v5' (a v5p), 'NVIDIA H100 80GB HBM3'
    device_memory_bytes: Optional[int]

    def mesh(self, data: int = 1, fsdp: int = 1, tensor: int = 1):
        """The training / decode mesh (axes data, fsdp, tensor) over the first data·fsdp·tensor devices."""
        import numpy as np
        from jax.sharding import Mesh

        n = data * fsdp * tensor
        if n > len(self.devices):
            raise ValueError(f"a mesh of data={data} x fsdp={fsdp} x tensor={tensor} = {n} devices does not fit "
                             f"topology {self.name!r}, which has {len(self.devices)}")
        return Mesh(np.array(self.devices[:n]).reshape(data, fsdp, tensor), ("data", "fsdp", "tensor"))

    def summary(self) -> dict:
        return {"topology": self.name, "platform": self.platform, "device_kind": self.device_kind,
                "devices": len(self.devices), "device_memory_bytes": self.device_memory_bytes}


def compilers_dir() -> str:
    """Where ``requirements-compilers.txt`` is installed (``pip install --no-deps --target .xla-compilers -r
    requirements-compilers.txt``, as README command 2 does): ``CONFU_JAX_COMPILERS``, else
    ``.xla-compilers`` in the repository. Its own folder, not the environment: with the CUDA plugin
    importable, every Pallas import on a machine without a GPU prints the plugin's absl lines
    ("cudart_stub.cc ... Could not find cuda drivers"), which would follow every CLI's one-line error."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.environ.get("CONFU_JAX_COMPILERS") or os.path.join(here, ".xla-compilers")


def use_compilers() -> bool:
    """Put :func:`compilers_dir` on ``sys.path`` (after the environment's own packages) and register the
    CUDA plugin with JAX if it was found after JAX looked for plugins. False where it is not there
    (then the environment's own libtpu / plugin, if any, are used)."""
    import sys

    d = compilers_dir()
    if not os.path.isdir(d):
        return False
    if d not in sys.path:
        sys.path.append(d)
        import importlib

        importlib.invalidate_caches()
    # JAX looks for plugins (jax_plugins.*) once, when its backends start: let it look now that the
    # folder is on the path (a no-op if it already looked). If it looked before, the CUDA plugin was
    # not found then, and registering it is ours; if it found it, registering again is refused
    # (ALREADY_EXISTS), which is fine. Registering before JAX's own look made that look fail with
    # a traceback on stderr.
    import jax.extend.backend

    jax.extend.backend.backends()
    try:
        import jax_plugins.xla_cuda12 as plugin

        plugin.initialize()
    except Exception:  # noqa: BLE001 - registered already, or no CUDA plugin there (the TPU compiler may be)
        pass
    return True


def _nvcc_dir() -> Optional[str]:
    """The ``nvidia-cuda-nvcc-cu12`` wheel's folder (bin/ptxas), if installed."""
    try:
        import nvidia.cuda_nvcc as m
    except ImportError:
        return None
    for p in getattr(m, "__path__", []):
        if os.path.isfile(os.path.join(p, "bin", "ptxas")):
            return p
    return None


def _point_xla_at_ptxas() -> None:
    """XLA:GPU needs a ptxas to compile; on a host with no CUDA toolkit, the nvcc wheel's. Set before
    the first GPU compile (XLA reads XLA_FLAGS once)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_cuda_data_dir" in flags:
        return
    import shutil

    if shutil.which("ptxas"):
        return
    d = _nvcc_dir()
    if d:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_cuda_data_dir={d}".strip()


def _refused(what: str, module: str, e: Exception) -> RuntimeError:
    """The compiler is not installed (say what to install), or it refused the topology (say why)."""
    import importlib.util

    try:
        installed = importlib.util.find_spec(module) is not None
    except ImportError:
        installed = False
    if installed:
        return RuntimeError(f"topology {what!r} was refused by its compiler: {type(e).__name__}: {e}")
    return RuntimeError(f"compiling for {what} needs its compiler on this host ({module} is not installed); "
                        f"install it with: pip install --no-deps --target {compilers_dir()} -r requirements-compilers.txt "
                        "(docs/install.md)")


def get_topology(name: str) -> Topology:
    """Compile-only devices for ``name``: a TPU topology as JAX names it (``v5p:2x2x2``, ``v5e:2x4``,
    ``v6e:2x2``, ``v4:2x2x1``) or ``h100:N`` / ``h200:N`` (N GPUs on one node)."""
    from jax.experimental import topologies

    use_compilers()
    name = name.strip().lower()
    m = GPU_TOPOLOGY.match(name)
    if m:
        gpu, n = m.group(1), int(m.group(2))
        if n < 1:
            raise ValueError(f"topology {name!r}: expected at least one GPU")
        _point_xla_at_ptxas()
        try:
            topo = topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(gpu),
                                                topology=f"1x1x{n}")
        except Exception as e:  # noqa: BLE001 - the plugin missing or refusing: say which
            raise _refused(name, "jax_plugins.xla_cuda12", e) from e
    elif TPU_TOPOLOGY.match(name):
        # libtpu takes a machine-wide lock (/tmp/libtpu_lockfile) for the chips it drives; a compile-only
        # client drives none, and two processes compiling at once (the test workers) must not refuse
        # each other. Read when libtpu loads: before the first topology.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        try:
            topo = topologies.get_topology_desc(platform="tpu", topology_name=name)
        except Exception as e:  # noqa: BLE001
            raise _refused(name, "libtpu", e) from e
    else:
        raise ValueError(f"unknown topology {name!r}: expected a TPU topology as JAX names it (v5p:2x2x2, "
                         f"v5e:2x4, v6e:2x2, v4:2x2x1) or h100:N / h200:N (N GPUs of one node)")
    devices = tuple(topo.devices)
    kind = devices[0].device_kind
    return Topology(name, platform_name(devices[0].platform), devices, kind, device_memory_bytes(kind))


def cpu_host() -> None:
    """Run this process's own JAX on the CPU unless ``JAX_PLATFORMS`` says otherwise: compiling for a
    topology needs no attached accelerator, and an installed CUDA plugin without a GPU would print an
    initialisation traceback. Call before the first JAX computation."""
    if "JAX_PLATFORMS" not in os.environ:
        import jax

        jax.config.update("jax_platforms", "cpu")


def is_compile_only(device) -> bool:
    """A device of a topology description (no hardware behind it: compile, never run)."""
    return type(getattr(device, "client", None)).__name__ == "CompileOnlyPyClient"


def out_of_memory(e: Exception, device_memory: Optional[int]) -> Optional[dict]:
    """The compiler's own "does not fit": XLA:TPU refuses at compile time a program whose buffers exceed
    the chip ("RESOURCE_EXHAUSTED: Ran out of memory ... required for HLO temporaries (284.55G) exceeds
    available HBM (15.75G)"). A report for it (``fits`` False, the bytes it names), or None for any other
    error."""
    text = str(e)
    if "RESOURCE_EXHAUSTED" not in text:
        return None
    m = re.search(r"required for [^(]*\(([\d.]+)([KMGT])\)", text)
    need = int(float(m.group(1)) * 2 ** (10 * "KMGT".index(m.group(2)) + 10)) if m else None
    return {"per_device_peak_bytes": need, "device_memory_bytes": device_memory, "fits": False,
            "compile_error": text.strip().splitlines()[0][:500]}


TRITON_GEMM_OFF = "--xla_gpu_enable_triton_gemm=false"


def untuned_tiling(e: Exception) -> Optional[ValueError]:
    """XLA:GPU with no device to autotune on compiles each GEMM fusion with its default Triton tiling, and
    for some shapes that default has no valid tiling ("Couldn't find output tile sizes that satisfy hlo:
    %dot = f32[8192,1024] ... split-k 16": P-EAGLE's 8B step at 16 rows of 4096 on ``h100:8``). A device
    would autotune past it, so it is a limit of compiling without one: the error that says what to do
    (compile those GEMMs through cuBLAS instead), or None for any other error."""
    text = str(e)
    if "Couldn't find output tile sizes" not in text:
        return None
    dot = re.search(r"%[\w.]+ = \w+\[[\d,]*\]", text)
    return ValueError(f"XLA:GPU compiling without a device (no autotuning) found no valid default Triton tiling "
                      f"for {dot.group(0) if dot else 'a GEMM'}; compile again with XLA_FLAGS={TRITON_GEMM_OFF} "
                      f"(those GEMMs through cuBLAS: the memory figure is then cuBLAS's)")


def memory_report(compiled, device_memory: Optional[int]) -> dict:
    """What one device holds for a compiled program (XLA's buffer assignment) and whether it fits."""
    m = compiled.memory_analysis()
    arg, out, tmp = (int(getattr(m, f"{k}_size_in_bytes", 0)) for k in ("argument", "output", "temp"))
    alias = int(getattr(m, "alias_size_in_bytes", 0))
    xla_peak = int(getattr(m, "peak_memory_in_bytes", 0) or 0)
    # The larger of XLA's own peak and its buffers' sum (arguments + outputs - donated + temporaries):
    # on XLA:TPU either can be the larger one (the peak leaves out part of the temporaries' allocation
    # in some programs, the sum leaves out program-level scratch in others), so "fits" uses both.
    peak = max(xla_peak, arg + out + tmp - alias)
    return {"argument_bytes": arg, "output_bytes": out, "temp_bytes": tmp, "alias_bytes": alias,
            "xla_peak_memory_bytes": xla_peak,
            "per_device_peak_bytes": peak, "device_memory_bytes": device_memory,
            "fits": None if device_memory is None else bool(peak <= device_memory)}


def ptxas_path() -> Optional[str]:
    """The ptxas XLA:GPU compiles with here: the nvcc wheel's (requirements-compilers.txt), else PATH's."""
    import shutil

    d = _nvcc_dir()
    return os.path.join(d, "bin", "ptxas") if d else shutil.which("ptxas")


def ptxas_usage(ptx_path: str, arch: str = "sm_90a") -> dict:
    """``ptxas -v`` of one PTX file -> {entry function: {registers, spill_stores, spill_loads}} (bytes
    for the spills): what each kernel of the file costs the SM's register file."""
    import subprocess

    exe = ptxas_path()
    if not exe:
        raise RuntimeError("no ptxas: install requirements-compilers.txt (the nvidia-cuda-nvcc-cu12 wheel)")
    p = subprocess.run([exe, "-v", f"-arch={arch}", ptx_path, "-o", os.devnull], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"ptxas refused {ptx_path}: {p.stderr.strip()[-500:]}")
    out, entry = {}, None
    for line in p.stderr.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            entry = out.setdefault(m.group(1), {})
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and entry is not None:
            entry.update(spill_stores=int(m.group(1)), spill_loads=int(m.group(2)))
        m = re.search(r"Used (\d+) registers", line)
        if m and entry is not None:
            entry["registers"] = int(m.group(1))
    return out


def gpu_kernel_usage(lowered, name: str, arch: str = "sm_90a") -> dict:
    """Compile ``lowered`` (a ``jax.stages.Lowered`` for a GPU topology) with XLA:GPU, dumping its PTX,
    and return ``ptxas_usage`` of the kernels whose entry name contains ``name`` (a ``pallas_call``'s
    ``name=``): {entry: {registers, spill_stores, spill_loads}}. Empty if no such kernel was emitted."""
    import glob
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        lowered.compile(compiler_options={"xla_dump_to": d})
        usage = {}
        for path in sorted(glob.glob(os.path.join(d, "*.ptx"))):
            with open(path) as f:
                if name not in f.read():
                    continue
            usage.update({k: v for k, v in ptxas_usage(path, arch).items() if name in k})
    return usage
