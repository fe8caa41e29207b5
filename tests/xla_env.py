"""The XLA flags of the test run: ``conftest.py`` sets ``EIGHT_DEVICES`` for the pytest processes (and
every subprocess that inherits the environment); a test that starts a CLI on one device passes
``SINGLE_DEVICE`` as the subprocess's ``XLA_FLAGS``.

``CODEGEN``: LLVM at -O1 instead of XLA:CPU's default -O2. Compiling is most of this suite's time, and
-O1 compiles the jitted loop's ~365 kernels in ~16% less time while running them as fast
(tests/test_mtp.py alone: 254 s -> 224 s; the chi-square and training tests, which run long: 176 s ->
174 s). It changes code generation, not semantics (no fast-math at either level).
"""

CODEGEN = "--xla_backend_optimization_level=1"
EIGHT_DEVICES = f"--xla_force_host_platform_device_count=8 {CODEGEN}"
SINGLE_DEVICE = CODEGEN
