"""Sharded loading: a Hugging Face target goes straight into its shardings, each process reading only
the slices its devices hold (``weights.load_model_sharded``), with no host copy of the model.

Checked on 8 fake devices against the host loader (``weights.load_model``, itself checked against
transformers in test_llama_parity / test_qwen_parity): equal values, each device holding 1/shards
of every sharded weight, and the checkpoint's bytes read exactly once per process however many
devices share a slice. Training reads its target this way (the fingerprint written to target.json
is the host loader's).
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from confu_jax import sharding as shd
from confu_jax.models.llama import init_params, param_shapes
from confu_jax.models.presets import get_preset
from confu_jax.weights import load_model, load_model_sharded
from confu_jax.weights.export import save_hf
from confu_jax.weights.hf import open_tensors
from confu_jax.weights.tree import ReadCounter

CFG = get_preset("tiny").replace(tie_embeddings=False, n_layers=4, vocab_size=256)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("hf_llama"))
    params = jax.device_get(init_params(CFG, jax.random.PRNGKey(3)))
    save_hf(CFG, params, d)
    return d


def _file_bytes(directory) -> int:
    files = open_tensors(directory)
    return sum(int(np.prod(f.info(n)[1])) * 4 for n, f in files.items())  # float32 file


@pytest.mark.parametrize("mesh_shape", [(1, 4, 2), (2, 4, 1), (1, 8, 1)])
def test_each_device_holds_its_slices_and_every_byte_is_read_once(checkpoint, mesh_shape):
    mesh = shd.make_mesh(*mesh_shape)
    shardings = shd.tree_shardings(param_shapes(CFG), mesh, axis_units=shd.llama_axis_units(CFG.head_dim))
    counter = ReadCounter()
    cfg, sharded = load_model_sharded(checkpoint, shardings, "float32", counter)
    _, host = load_model(checkpoint, "float32")
    assert cfg == load_model(checkpoint, "float32")[0]
    n_split = 0
    for (path, a), b, s in zip(jax.tree_util.tree_leaves_with_path(sharded), jax.tree_util.tree_leaves(host),
                               jax.tree_util.tree_leaves(shardings)):
        assert a.sharding == s, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
        want = s.shard_shape(a.shape)
        assert all(sh.data.shape == want for sh in a.addressable_shards)
        n_split += int(np.prod(want)) < int(np.prod(a.shape))
    assert n_split >= 9  # the projections, MLP, embedding and LM head are split, not replicated
    assert counter.bytes == _file_bytes(checkpoint)  # replicated slices are read once, not per device


def test_training_reads_a_hugging_face_target_sharded(checkpoint, tmp_path):
    """``build_task`` on a Hugging Face source loads the target into the run's shardings (no host tree
    in the task) and writes the same target fingerprint the host loader gives."""
    from configs.common import base_config
    from confu_jax.runs.heads import read_target_record, target_fingerprint
    from confu_jax.train.loop import run_target_fingerprint, setup_run, write_run_files
    from tests.helpers.tiny_checkpoints import write_hf_tokenizer

    write_hf_tokenizer(checkpoint)
    data = tmp_path / "train.jsonl"
    rows = [{"messages": [{"role": "user", "content": "a b c"}, {"role": "assistant", "content": "d e f g " * 3}]}]
    data.write_text("\n".join(json.dumps(r) for r in rows * 40) + "\n")
    config = base_config(None, "eagle3")
    with config.unlocked():
        config.model.source = checkpoint
        config.data.train_files = str(data)
        config.data.max_length = 32
        config.data.global_batch_size = 8
        config.objective.eval_records = 0
        config.train.mesh.fsdp = 4
        config.train.mesh.tensor = 2
        config.train.mesh.data = 1
    run = setup_run(config)
    leaves = jax.tree_util.tree_leaves(run.frozen)
    assert all(isinstance(x, jax.Array) for x in leaves)
    emb = run.frozen["embed"]["embedding"]
    assert emb.addressable_shards[0].data.shape == emb.sharding.shard_shape(emb.shape)
    assert np.prod(emb.addressable_shards[0].data.shape) * 8 == np.prod(emb.shape)  # split over all 8 devices
    os.makedirs(tmp_path / "w")
    write_run_files(config, str(tmp_path / "w"), run, run_target_fingerprint(run))
    _, host = load_model(checkpoint, "float32")
    assert read_target_record(str(tmp_path / "w"))["fingerprint"] == target_fingerprint(host)
