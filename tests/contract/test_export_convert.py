"""``launch.export_head`` converts any EAGLE-3 head the project loads — a release, a published head in
the official or the speculators layout — to either layout, and stores the dtype a serving engine
runs the target in (docs/interop.md "Serving")."""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest

from confu_jax.decode.families import EXPORT_FORMATS
from confu_jax.runs.exports import target_dtype
from confu_jax.weights.tensor_files import read_tensors
from confu_jax.weights.export import hf_config_dict

ROOT = pathlib.Path(__file__).resolve().parents[2]
RELEASED_E3 = ROOT / "releases" / "heads" / "smollm2_eagle3"


def _write(fmt, source, out, **kw):
    options = {o: kw.pop(o, None) for o in EXPORT_FORMATS[fmt].options}
    return EXPORT_FORMATS[fmt].write(str(source), str(out), step=kw.pop("step", None), dtype=kw.pop("dtype", None),
                                     target=None, target_source="", **options)


def _config_only_target(directory: pathlib.Path, dtype: str) -> pathlib.Path:
    """SmolLM2's config.json alone (what the export reads of a target), stored as ``dtype``."""
    from confu_jax.weights import read_architecture

    cfg = read_architecture("smollm2-135m-instruct")
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({**hf_config_dict(cfg), "dtype": dtype}))
    return directory


def test_release_to_speculators_and_back_is_bit_exact(tmp_path):
    spec_dir, back = tmp_path / "spec", tmp_path / "back"
    _write("speculators", RELEASED_E3, spec_dir, dtype="bfloat16", verifier="smollm2-135m-instruct")
    config = json.loads((spec_dir / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["dtype"] == "bfloat16"
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]  # SmolLM2's default taps, written out
    _write("eagle3", spec_dir, back, dtype="bfloat16")  # no manifest: the verifier names the target
    theirs, ours = read_tensors(str(RELEASED_E3)), read_tensors(str(back))
    assert sorted(theirs) == sorted(ours)
    for name in theirs:
        assert theirs[name].dtype == ours[name].dtype and np.array_equal(theirs[name], ours[name]), name
    assert json.loads((back / "config.json").read_text()) == json.loads((RELEASED_E3 / "config.json").read_text())


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_default_dtype_is_the_targets(tmp_path, dtype):
    target = _config_only_target(tmp_path / "target", dtype)
    assert target_dtype(str(target)) == dtype
    out = tmp_path / "out"
    _write("speculators", RELEASED_E3, out, target_model=str(target))
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == dtype and config["transformer_layer_config"]["torch_dtype"] == dtype
    assert {a.dtype.name for k, a in read_tensors(str(out)).items() if k not in ("d2t", "t2d")} == {dtype}


def test_published_head_without_a_target_is_one_line(tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    from confu_jax.runs.head_release import unpacked_release

    for name in ("config.json", "model.safetensors"):  # the official layout without a release manifest
        shutil.copy(pathlib.Path(unpacked_release(str(RELEASED_E3))) / name, bare / name)
    with pytest.raises(ValueError, match="names no target; pass --target"):
        _write("eagle3", bare, tmp_path / "out")
    with pytest.raises(ValueError, match="holds one set of weights"):
        _write("eagle3", bare, tmp_path / "out", step=3, target_model="smollm2-135m-instruct")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="not a launch.train workdir"):
        _write("eagle3", tmp_path, tmp_path / "out")
