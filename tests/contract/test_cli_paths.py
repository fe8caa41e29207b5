"""No command-line entry point touches a user's path with ``os`` / ``open`` / ``pathlib`` itself.

Why: a path flag may be a ``gs://`` URL (docs/scale.md "Cloud Storage paths"), and the ``os`` calls
turn one into a local path without a word — ``os.path.abspath('gs://b/run')`` is ``/cwd/gs:/b/run``,
``open('gs://b/x.jsonl', 'w')`` writes a local ``./gs:/b/x.jsonl``. Every file a ``launch/*.py``
module reads or writes therefore goes through ``confu_jax.storage``, which keeps the ``os`` calls for
a local path and uses the object store for a remote one.

The check is an AST scan of ``launch/*.py`` for the calls that touch or rewrite a path:
``open``, ``os.path.abspath / realpath / normpath / exists / isfile / isdir / getsize``,
``os.makedirs / listdir / remove / rename / replace / chmod``, ``shutil.*``, ``glob.*`` and
``Path(...)``. Pure string operations (``os.path.join / dirname / basename / splitext /
expanduser``) are allowed: on a POSIX host they are exact on URLs too. A call is exempt when its
arguments come only from ``__file__`` or literals (the repository's own files), or when it is in
``ALLOWED`` below, each entry with why its path is never a user's.
"""

from __future__ import annotations

import ast
import glob
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PATH_FUNCS = {
    "os.path": {"abspath", "realpath", "normpath", "exists", "lexists", "isfile", "isdir", "islink", "getsize",
                "getmtime", "samefile"},
    "os": {"makedirs", "mkdir", "listdir", "scandir", "walk", "remove", "unlink", "rename", "replace", "rmdir",
           "chmod", "stat"},
}
ANY_OF = {"shutil", "glob", "pathlib"}  # every function of these modules takes a path
NAMES = {"open", "Path", "PurePath"}

# (file, the call as ast.unparse writes it) -> why that path is never a user's
ALLOWED = {
    ("sweep.py", "os.chmod(path, 493)"):
        "a --mode=hosts script, made executable only when the sweep directory is local (storage.is_remote "
        "is checked on the line above; an object has no mode bits)",
    ("sweep.py", "open(local_log, 'a')"):
        "the child process's output needs a file descriptor: _local_log gives the point's log itself when "
        "local, else a temporary local copy that it uploads when the run stops",
    ("quickstart.py", "os.rename(workdir, stale)"):
        "a folder under the quickstart's cache, which cache_root() refuses unless it is local",
}


def _dotted(node) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _touches_a_path(call: ast.Call) -> bool:
    name = _dotted(call.func)
    if name in NAMES:
        return True
    module, _, func = name.rpartition(".")
    return func in PATH_FUNCS.get(module, ()) or module in ANY_OF or module.split(".")[0] in ANY_OF


def _only_repo_files(call: ast.Call) -> bool:
    """Every value the call's arguments are made of is ``__file__`` or a literal."""
    leaves = [n for a in [*call.args, *(k.value for k in call.keywords)] for n in ast.walk(a)
              if isinstance(n, ast.Name) and n.id not in ("os", "__file__")]
    return not leaves


def path_calls(source: str) -> list[tuple[int, str]]:
    """(line, call) of every call in ``source`` that applies a path function to something other than
    the repository's own files."""
    return sorted((n.lineno, ast.unparse(n)) for n in ast.walk(ast.parse(source))
                  if isinstance(n, ast.Call) and _touches_a_path(n) and not _only_repo_files(n))


def test_the_scan_finds_each_kind_of_call():
    """The check itself: each forbidden form is found, the repository's own files and string
    operations are not."""
    found = path_calls("\n".join([
        "os.path.abspath(FLAGS.workdir)", "open(FLAGS.out, 'w')", "os.makedirs(d, exist_ok=True)",
        "shutil.copytree(a, b)", "Path(p).read_text()", "glob.glob(pattern)", "os.path.isfile(path)",
        "os.path.join(FLAGS.out, 'x')", "os.path.dirname(os.path.abspath(__file__))",
        "os.path.basename(path)", "open('/proc/cpuinfo')",
    ]))
    assert [line for line, _ in found] == [1, 2, 3, 4, 5, 6, 7], found


def test_no_cli_applies_os_or_open_to_a_user_path():
    bad, used = [], set()
    for path in sorted(glob.glob(os.path.join(ROOT, "launch", "*.py"))):
        name = os.path.basename(path)
        with open(path, encoding="utf-8") as f:
            for line, call in path_calls(f.read()):
                if (name, call) in ALLOWED:
                    used.add((name, call))
                else:
                    bad.append(f"launch/{name}:{line}: {call}")
    assert not bad, ("these calls would turn a gs:// flag value into a local path; use confu_jax.storage "
                     "(or, for a path that is never a user's, add it to ALLOWED with why):\n" + "\n".join(bad))
    assert used == set(ALLOWED), f"ALLOWED entries that match no call any more: {sorted(set(ALLOWED) - used)}"


def test_every_cli_runs_behind_the_user_error_boundary():
    """Every ``app.run`` in ``launch/`` runs its main through ``user_errors.cli_main``: the boundary that
    checks each ``gs://`` value on the command line against the installed backend before any work
    (one line naming the path and ``pip install -r requirements-cloud.txt``) and turns a user's
    mistake into one line, exit 2."""
    bare = []
    for path in sorted(glob.glob(os.path.join(ROOT, "launch", "*.py"))):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and _dotted(n.func) == "app.run":
                main = n.args[0] if n.args else None
                if not (isinstance(main, ast.Call) and _dotted(main.func) == "cli_main"):
                    bare.append(f"launch/{os.path.basename(path)}:{n.lineno}: {ast.unparse(n)}")
    assert not bare, "wrap main in confu_jax.user_errors.cli_main:\n" + "\n".join(bare)


# Python as if the cloud extra were not installed: importlib finds no gcsfs (nor TensorFlow's GCS
# filesystem), then the command runs as ``python -m``.
_NO_CLOUD_EXTRA = ("import runpy, sys; sys.modules['gcsfs'] = None; sys.modules['tensorflow'] = None; "
                   "sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")
_B = "gs://no-extra-bucket"


@pytest.mark.slow
@pytest.mark.parametrize("module,args", [
    ("launch.export_head", ["--workdir", f"{_B}/run", "--out", f"{_B}/export"]),
    ("launch.release_head", ["--workdir", "runs/local_run", "--release", f"{_B}/release"]),
    ("launch.generate_data", ["--output", f"{_B}/distill.jsonl", "--max_records", "1"]),
    ("launch.release_data", ["--input", f"{_B}/distill.jsonl", "--release", "releases_tmp/x"]),
    ("launch.decode_bench", ["--methods", "ar", "--out", f"{_B}/bench.json"]),
    ("launch.sweep", ["--spec", "sweeps/smollm2_eagle3_lr_ktrain.py", f"--sweep_dir={_B}/sweep"]),
    ("launch.plot_training", ["--runs", f"e3=runs/a,confu={_B}/run@200", "--out", "curves.png"]),
    ("launch.generate", ["--prompt", "Hi", "--method", "eagle3", "--draft_ckpt", f"{_B}/run"]),
])
def test_a_gs_path_without_the_cloud_extra_is_one_line_before_any_work(module, args, tmp_path):
    """Each command with a ``gs://`` value and no gcsfs: exit 2 and one line naming the path and the
    install command, before anything is written (no local ``gs:`` folder, no output file)."""
    import subprocess
    import sys

    from tests.helpers.xla_env import SINGLE_DEVICE

    env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=SINGLE_DEVICE, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", _NO_CLOUD_EXTRA, module, *args], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    lines = [ln for ln in r.stderr.splitlines() if _B in ln]
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"{module}: {_B}/"), r.stderr[-2000:]
    assert "gcsfs" in lines[0] and "pip install -r requirements-cloud.txt" in lines[0], lines[0]
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)  # nothing written, no ./gs:/... folder
