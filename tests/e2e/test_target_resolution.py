"""The checkpoint decides the architecture: ``resolve_target`` / ``resolve_run_config`` on the configs
a user trains with, and the one-line errors of the CLIs on what a user gets wrong."""

import json
import os
import subprocess
import sys
import types

import pytest

from configs import confu as confu_config
from configs import eagle3 as eagle3_config
from configs import smollm2_eagle3
from confu_jax.models.spec import model_spec_from_config
from confu_jax.train.target_loading import default_draft_vocab, resolve_target
from confu_jax.train.task import data_parallel_devices, resolve_run_config
from confu_jax.weights import read_architecture
from tests.helpers.tiny_checkpoints import hf_qwen, write_hf_tokenizer
from tests.helpers.xla_env import SINGLE_DEVICE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3")
    hf_qwen(d, family="qwen3", seed=1, vocab=300, hidden=48, layers=6, heads=4, kv_heads=2, head_dim=24, ffn=80,
            dtype="bfloat16")
    write_hf_tokenizer(d, generation_eos=[2, 0])
    return str(d)


def test_default_draft_vocab():
    # a quarter, a multiple of 64, at most 32000 (EAGLE-3's Llama-3 heads, SpecForge's Qwen3 heads)
    assert default_draft_vocab(128256) == 32000 and default_draft_vocab(151936) == 32000
    assert default_draft_vocab(49152) == 12288 and default_draft_vocab(32000) == 8000
    assert default_draft_vocab(300) == 256 and default_draft_vocab(96) == 96  # tiny: at least min(V, 256)


def test_the_checkpoint_sizes_a_config_without_a_preset(qwen_dir):
    config = eagle3_config.get_config()
    assert config.model.preset is None and config.model.dtype is None and config.draft.draft_vocab_size is None
    with pytest.raises(ValueError, match="model.source is empty for this config"):
        resolve_target(config)
    config.model.source = qwen_dir
    resolve_target(config)
    arch = read_architecture(qwen_dir)
    spec = model_spec_from_config(config)
    assert spec.target == arch  # every architecture field, the dtype (the checkpoint's bf16) included
    assert spec.target.qk_norm and spec.target.head_dim == 24 and spec.target.eos_token_ids == (0, 2)
    assert config.model.dtype == config.draft.dtype == "bfloat16"
    assert spec.head.draft_vocab_size == config.data.draft_vocab_size == 256
    # what a run's config.json holds rebuilds the same spec without the checkpoint
    import ml_collections

    saved = ml_collections.ConfigDict(json.loads(config.to_json_best_effort()))
    saved.model.source = "/nowhere"
    assert model_spec_from_config(saved).target == arch
    # overrides win over the checkpoint's defaults, and resolving twice changes nothing
    c2 = confu_config.get_config()
    c2.model.source, c2.model.dtype, c2.draft.draft_vocab_size = qwen_dir, "float32", 128
    resolve_target(c2)
    resolve_target(c2)
    assert (c2.model.dtype, c2.model.param_dtype, c2.draft.draft_vocab_size) == ("float32", "bfloat16", 128)


def test_a_preset_the_checkpoint_disagrees_with_is_refused_by_key(qwen_dir):
    config = smollm2_eagle3.get_config()
    config.model.source = qwen_dir
    with pytest.raises(ValueError, match=r"vocab_size is 300 in the checkpoint; preset 'smollm2-135m' expects 49152"):
        resolve_target(config)


def _mesh(**shape):
    return types.SimpleNamespace(shape=shape)


def test_global_batch_defaults_to_a_multiple_of_the_data_parallel_devices(qwen_dir):
    config = eagle3_config.get_config()
    config.model.source = qwen_dir
    assert config.data.global_batch_size == 0
    resolved = resolve_run_config(config, _mesh(data=32, fsdp=1, tensor=1))  # a 32-chip pod
    assert resolved.data.global_batch_size == 32 and config.data.global_batch_size == 0  # the caller's is kept
    assert resolve_run_config(resolved, _mesh(data=2, fsdp=2, tensor=2)) is resolved  # resolved once
    with pytest.raises(AttributeError, match="immutable"):
        resolved.data.global_batch_size = 8
    assert resolve_run_config(config, _mesh(data=2, fsdp=2, tensor=2)).data.global_batch_size == 16  # 4 dp devices
    config.data.global_batch_size = 24
    with pytest.raises(ValueError, match=r"data.global_batch_size=24 does not divide over the 32 data-parallel "
                                         r"devices.*multiple of 32"):
        resolve_run_config(config, _mesh(data=8, fsdp=4, tensor=1))
    assert data_parallel_devices(config) >= 1  # this process's devices under config.train.mesh


def _cli(*args):
    env = dict(os.environ, XLA_FLAGS=SINGLE_DEVICE, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_cli_mistakes_are_one_line(qwen_dir, tmp_path):
    # a preset config given another model's checkpoint
    r = _cli("launch.train", "--config", "configs/smollm2_eagle3.py", "--workdir", str(tmp_path / "w"),
             f"--config.model.source={qwen_dir}")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "preset 'smollm2-135m' expects 49152" in r.stderr.strip().splitlines()[-1]
    # an unsupported architecture, named with its file
    bad = tmp_path / "moe"
    bad.mkdir()
    with open(os.path.join(qwen_dir, "config.json")) as f:
        c = json.load(f)
    c.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"])
    (bad / "config.json").write_text(json.dumps(c))
    r = _cli("launch.train", "--config", "configs/eagle3.py", "--workdir", str(tmp_path / "w2"),
             f"--config.model.source={bad}")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"{bad}/config.json: model_type 'qwen3_moe'" in r.stderr
    # a tokenizer without a chat template
    notemplate = tmp_path / "notemplate"
    notemplate.mkdir()
    for name in os.listdir(qwen_dir):
        (notemplate / name).write_bytes(open(os.path.join(qwen_dir, name), "rb").read())
    tc = json.loads((notemplate / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (notemplate / "tokenizer_config.json").write_text(json.dumps(tc))
    if (notemplate / "chat_template.jinja").exists():
        (notemplate / "chat_template.jinja").unlink()
    r = _cli("launch.generate", "--model", str(notemplate), "--prompt", "hi", "--max_new_tokens", "2")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "no chat template" in r.stderr and str(notemplate) in r.stderr
