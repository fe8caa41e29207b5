"""A user's mistake reaches them as one line on stderr and exit status 2 (``confu_jax.user_errors``), not a
traceback ending in a good message; a family's default plan fits it (``decode.families.DrafterFamily.default_plan``)."""

import os
import shutil
import subprocess
import sys

import pytest

from confu_jax.decode.families import FAMILIES
from tests.helpers.xla_env import SINGLE_DEVICE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _generate(*args):
    env = dict(os.environ, XLA_FLAGS=SINGLE_DEVICE, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    env.pop("CONFU_JAX_TRACEBACK", None)
    return subprocess.run([sys.executable, "-m", "launch.generate", "--prompt", "hi", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def _user_lines(stderr: str) -> list:
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith(("I1", "W1"))]


@pytest.fixture(scope="module")
def bad_release(tmp_path_factory):
    """The released EAGLE-3 head with one byte of its weights changed (its manifest's hash no longer matches)."""
    d = tmp_path_factory.mktemp("rel") / "smollm2_eagle3"
    shutil.copytree(os.path.join(REPO, "releases", "heads", "smollm2_eagle3"), d)
    with open(d / "model.safetensors.xz", "r+b") as f:
        f.seek(-3, 2)
        b = f.read(1)
        f.seek(-3, 2)
        f.write(bytes([b[0] ^ 1]))
    return str(d)


@pytest.fixture(scope="module")
def bad_release_broken_manifest(bad_release, tmp_path_factory):
    """The altered release whose manifest no longer parses: the check must refuse it, not be skipped."""
    d = tmp_path_factory.mktemp("rel2") / "smollm2_eagle3"
    shutil.copytree(bad_release, d)
    text = (d / "manifest.json").read_text()
    (d / "manifest.json").write_text(text[: len(text) // 2])
    return str(d)


@pytest.mark.slow
@pytest.mark.parametrize("args,says", [
    (["--max_new_tokens", "-5"], "max_new_tokens must be >= 1, got -5"),
    (["--method", "eagle3", "--tree", "garbage:9"], "bad draft plan 'garbage:9'"),
    (["--method", "eagle3", "--draft_ckpt", "/nonexistent/run"], "not a launch.train workdir"),
    (["--method", "confu", "--draft_ckpt", os.path.join(REPO, "releases", "heads", "smollm2_eagle3")],
     "holds an EAGLE-3 head"),
    (["--method", "mlp_speculator", "--tree", "chain:4"], "drafts 4 deep; the mlp_speculator weights of MLP speculator reference initialisation (3 stages, seed 0) draft at most 3 deep"),
    ("bad_release", "sha256"),
    ("bad_release_broken_manifest", "manifest.json: the manifest does not parse"),
    (["--tree", "chain:4", "--draft_ckpt", "/some/run"], "--draft_ckpt / --plan set, but --method ar drafts nothing"),
], ids=["negative_tokens", "garbage_plan", "missing_ckpt", "confu_on_eagle3_head", "too_deep_for_family",
        "release_hash", "release_hash_broken_manifest", "plan_for_ar"])
def test_a_mistake_is_one_line_and_exit_2(args, says, request):
    if isinstance(args, str):  # a release fixture
        args = ["--method", "eagle3", "--draft_ckpt", request.getfixturevalue(args)]
    r = _generate(*args)
    lines = _user_lines(r.stderr)
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("launch.generate: ") and says in lines[0], lines


@pytest.mark.parametrize("module,args,says", [
    ("launch.export_head", ["--workdir", "/nonexistent/run", "--out", "/tmp/unused"], "not a launch.train workdir"),
    ("launch.train", ["--config", "configs/tiny.py", "--workdir", "WORK", "--config.model.source=/nonexistent/m"],
     "neither a known asset"),
    ("launch.generate_data", ["--output", "WORK/o.jsonl", "--input", "/nonexistent.json"], "does not exist"),
    ("launch.train", ["--config", "configs/tiny.py:eagle3", "--workdir", "WORK/run", "--config.train.steps=1",
                      "--config.train.checkpoint.init_from=RELEASE"], "manifest.json: the manifest does not parse"),
], ids=["export_head", "train", "generate_data", "train_init_from_broken_release"])
def test_every_cli_reports_a_mistake_as_one_line(module, args, says, tmp_path, request):
    if any("RELEASE" in a for a in args):
        rel = request.getfixturevalue("bad_release_broken_manifest")
        args = [a.replace("RELEASE", rel) for a in args]
    env = dict(os.environ, XLA_FLAGS=SINGLE_DEVICE, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    env.pop("CONFU_JAX_TRACEBACK", None)
    args = [a.replace("WORK", str(tmp_path)) for a in args]
    r = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600)
    lines = [line for line in _user_lines(r.stderr) if not line.startswith("INFO")]
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"{module}: ") and says in lines[0], lines


def test_the_default_plan_fits_a_depth_bounded_family():
    from types import SimpleNamespace

    import jax

    import jax.numpy as jnp

    from confu_jax.models.medusa import init_medusa
    from confu_jax.models.mlp_speculator import MLPSpeculatorConfig, init_mlp_speculator

    assert FAMILIES["head"].default_plan(SimpleNamespace(weights={})) == "chain:4"  # a head drafts at any depth
    medusa = init_medusa(jax.random.PRNGKey(0), 2, 1, jnp.zeros((40, 16)), 0)
    assert FAMILIES["medusa"].default_plan(SimpleNamespace(weights={"medusa": medusa})) == "chain:2"
    spec = init_mlp_speculator(jax.random.PRNGKey(0), MLPSpeculatorConfig(3, 16, 16, 40))
    assert FAMILIES["mlp_speculator"].default_plan(SimpleNamespace(weights={"mlp_speculator": spec})) == "chain:3"


@pytest.mark.parametrize("module,args,key", [
    ("launch.generate", ["--prompt", "hi", "--config.decode.max_new_token=4"], "--config.decode.max_new_token"),
    ("launch.train", ["--config", "configs/tiny.py", "--workdir", "WORK", "--config.train.stepz=4"], "--config.train.stepz"),
    ("launch.param_count", ["--config", "configs/tiny.py", "--config.model.presett=tiny"], "--config.model.presett"),
    ("launch.target_features", ["--config", "configs/tiny.py", "--out", "WORK/s", "--config.data.max_lenght=8"],
     "--config.data.max_lenght"),
], ids=["generate", "train", "param_count", "target_features"])
def test_a_config_typo_is_one_line_naming_the_key_in_every_config_cli(module, args, key, tmp_path):
    """ml_collections raises a KeyError deep in absl's flag parsing (for launch.generate, whose config has a
    default file, while its flags are defined): one line, exit 2, the key and ml_collections' suggestion."""
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    env.pop("CONFU_JAX_TRACEBACK", None)
    args = [a.replace("WORK", str(tmp_path)) for a in args]
    r = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    lines = _user_lines(r.stderr)
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"{module}: invalid config override in {key}:"), lines
    assert "Did you mean" in lines[0]
