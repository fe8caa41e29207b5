"""The XLA flags of the test run: ``conftest.py`` sets ``EIGHT_DEVICES`` for the pytest processes (and
every subprocess that inherits the environment); a test that starts a CLI on one device passes
``SINGLE_DEVICE`` as the subprocess's ``XLA_FLAGS``. The product itself sets none of these.

``CODEGEN``: LLVM at -O1 instead of XLA:CPU's default -O2, **with code generation capped at AVX2**.

* Why -O1: compiling is most of this suite's time, and -O1 compiles the jitted loop's ~365 kernels in
  less time while running them as fast (AVX2 host: tests/unit/test_mtp.py 254 s -> 224 s; AVX-512 host:
  104 s -> 96 s). It changes code generation, not semantics (no fast-math at either level).
* Why the AVX2 cap (``--xla_cpu_max_isa=AVX2``): on hosts with AVX-512 (Intel Xeon with AVX-512/AMX,
  AMD EPYC Zen 4/5), jaxlib 0.10.2's LLVM at -O1 aborts the whole process while selecting
  instructions for some small integer fusions (``LLVM ERROR: Cannot select: v8i32 =
  X86ISD::SUBV_BROADCAST_LOAD`` in a ``compare_and_fusion``; first seen compiling the lookup
  drafter's loop). The default -O2 and -O1 capped at AVX2 both compile it. With the cap, LLVM emits
  the AVX2 code it emits on AVX2-only hosts, where the whole suite has passed at -O1 many times, so
  every host runs the same, proven instruction selection; the cap alone changes no timing measured
  (tests/unit/test_mtp.py on the AVX-512 host: 104 s default, 105 s capped at -O2, 96 s capped at -O1).
  ``tests/contract/test_codegen_safety.py`` keeps the smallest program found that triggers the abort and
  checks that it compiles, and computes the right values, under these flags.
"""

CODEGEN = "--xla_backend_optimization_level=1 --xla_cpu_max_isa=AVX2"
EIGHT_DEVICES = f"--xla_force_host_platform_device_count=8 {CODEGEN}"
SINGLE_DEVICE = CODEGEN
