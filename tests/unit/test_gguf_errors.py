"""Truncated or malformed GGUF files fail with a CheckpointError naming the file and, when the
damage is in the tensor directory or tensor data, the tensor -- never a bare ValueError from mmap,
a struct.error or a numpy offset error.

Damaged variants are cut or overwritten copies of one tiny GGUF written by the ``gguf`` package;
byte positions are located with ``gguf.GGUFReader`` (an independent parser), not with ours.
"""

import re
import struct

import numpy as np
import pytest

from confu_jax.weights import CheckpointError, load_gguf, load_model
from confu_jax.weights.gguf import GGUFFile
from tests.helpers.tiny_checkpoints import hf_llama, write_gguf

LAYERS = 2
ENTRY_POINTS = {
    "load_model": load_model,
    "load_gguf": load_gguf,
    "GGUFFile": GGUFFile,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(path of an intact GGUF, its bytes, the torch model it was written from, gguf.GGUFReader of it)."""
    import gguf

    d = tmp_path_factory.mktemp("gguf_errors")
    model = hf_llama(d / "hf", seed=3, vocab=300, layers=LAYERS)
    path = str(d / "intact.gguf")
    write_gguf(path, model)
    with open(path, "rb") as f:
        data = f.read()
    return path, data, model, gguf.GGUFReader(path)


def _tensor(reader, name):
    (t,) = [t for t in reader.tensors if t.name == name]
    return t


def _info_pos(data, name):
    """Byte offset just after ``name``'s string in the tensor-info table (dims count follows)."""
    needle = struct.pack("<Q", len(name)) + name.encode()
    pos = data.find(needle)
    assert pos > 0 and data.find(needle, pos + 1) == -1
    return pos + len(needle)


def _damaged(tmp_path, data):
    p = tmp_path / "damaged.gguf"
    p.write_bytes(data)
    return str(p)


def _raises(path, entry, pattern):
    with pytest.raises(CheckpointError, match=pattern) as ei:
        ENTRY_POINTS[entry](path)
    msg = str(ei.value)
    assert path in msg, msg
    return msg


@pytest.fixture(params=list(ENTRY_POINTS))
def entry(request):
    return request.param


@pytest.mark.slow
def test_intact_file_loads_same_params(tiny):
    path, _, model, _ = tiny
    cfg, params = load_model(path)
    assert (cfg.vocab_size, cfg.n_layers, cfg.d_model) == (300, LAYERS, 64)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    np.testing.assert_array_equal(np.asarray(params["embed"]["embedding"]), sd["model.embed_tokens.weight"])
    np.testing.assert_array_equal(np.asarray(params["final_norm"]["scale"]), sd["model.norm.weight"])
    np.testing.assert_array_equal(np.asarray(params["lm_head"]["kernel"]), sd["lm_head.weight"].T)
    hf = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
          "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
          "down_proj": "mlp.down_proj"}
    for i in range(LAYERS):
        for ours, theirs in hf.items():
            np.testing.assert_array_equal(np.asarray(params["layers"][ours]["kernel"][i]),
                                          sd[f"model.layers.{i}.{theirs}.weight"].T, err_msg=f"{ours} {i}")
        np.testing.assert_array_equal(np.asarray(params["layers"]["attn_norm"]["scale"][i]),
                                      sd[f"model.layers.{i}.input_layernorm.weight"])
        np.testing.assert_array_equal(np.asarray(params["layers"]["mlp_norm"]["scale"][i]),
                                      sd[f"model.layers.{i}.post_attention_layernorm.weight"])
    g = GGUFFile(path)  # the lower-level reader agrees on the tensor directory
    assert set(g.tensors) == {t.name for t in tiny[3].tensors}


def test_empty_file(tmp_path, entry):
    path = _damaged(tmp_path, b"")
    _raises(path, entry, r"file is empty \(0 bytes\)")


def test_header_only(tiny, tmp_path, entry):
    """Magic, version and counts, then nothing: the first metadata entry is missing."""
    path = _damaged(tmp_path, tiny[1][:24])
    _raises(path, entry, r"truncated or corrupt GGUF: metadata entry 1 of \d+ needs bytes \[24, 32\) but the file has 24 bytes")


@pytest.mark.parametrize("cut", [4, 12, 23])
def test_cut_inside_fixed_header(tiny, tmp_path, cut):
    path = _damaged(tmp_path, tiny[1][:cut])
    _raises(path, "load_model", rf"truncated GGUF header: .* need bytes \[0, 24\) but the file has {cut} bytes")


def test_shorter_than_magic(tiny, tmp_path):
    path = _damaged(tmp_path, tiny[1][:2])
    _raises(path, "load_model", r"truncated GGUF: the file has 2 bytes")


@pytest.mark.parametrize("name,frac", [("blk.0.attn_q.weight", 0.5), ("token_embd.weight", 0.25),
                                       ("blk.1.ffn_down.weight", 0.9)])
def test_cut_in_middle_of_tensor(tiny, tmp_path, entry, name, frac):
    _, data, _, reader = tiny
    t = _tensor(reader, name)
    start, end = int(t.data_offset), int(t.data_offset) + int(t.n_bytes)
    cut = start + int(t.n_bytes * frac)
    path = _damaged(tmp_path, data[:cut])
    msg = _raises(path, entry, rf"tensor '{re.escape(name)}' .* needs bytes \[{start}, {end}\) but the file has {cut} bytes")
    assert "truncated GGUF" in msg


def test_cut_one_byte_short(tiny, tmp_path):
    _, data, _, reader = tiny
    last = max(reader.tensors, key=lambda t: t.data_offset)
    path = _damaged(tmp_path, data[:-1])
    _raises(path, "load_model", rf"tensor '{re.escape(last.name)}' .* but the file has {len(data) - 1} bytes$")


def test_tensor_data_section_missing(tiny, tmp_path, entry):
    """Cut right after the tensor-info table: the first tensor is named, and the rest counted."""
    _, data, _, reader = tiny
    first = min(reader.tensors, key=lambda t: t.data_offset)
    last_info = max(reader.tensors, key=lambda t: t.field.offset)
    info_end = _info_pos(data, last_info.name) + 4 + 8 * len(last_info.shape) + 4 + 8
    path = _damaged(tmp_path, data[:info_end])
    _raises(path, entry, rf"tensor '{re.escape(first.name)}' .* but the file has {info_end} bytes; "
                         rf"{len(reader.tensors) - 1} more tensor\(s\) lie past the end")


@pytest.mark.parametrize("where", ["name", "dims", "type_offset"])
def test_cut_inside_tensor_info(tiny, tmp_path, entry, where):
    _, data, _, _ = tiny
    name = "blk.1.ffn_up.weight"
    after_name = _info_pos(data, name)
    if where == "name":  # cut inside the name itself: the previous tensor info is named
        cut = after_name - 5
        pattern = r"tensor info \d+ of \d+ \(after '[^']+'\) needs bytes"
    else:
        cut = after_name + (4 + 3 if where == "dims" else 4 + 16 + 6)
        pattern = rf"tensor info for '{re.escape(name)}' \(\d+ of \d+\) needs bytes \[\d+, \d+\) but the file has {cut} bytes"
    path = _damaged(tmp_path, data[:cut])
    _raises(path, entry, pattern)


def test_cut_inside_metadata_array(tiny, tmp_path, entry):
    _, data, _, _ = tiny
    key = b"tokenizer.ggml.tokens"
    cut = data.find(key) + len(key) + 4 + 12 + 100  # inside the token strings
    path = _damaged(tmp_path, data[:cut])
    _raises(path, entry, rf"metadata key 'tokenizer\.ggml\.tokens' \(entry \d+ of \d+\) needs bytes \[\d+, \d+\) "
                         rf"but the file has {cut} bytes")


def test_bad_magic(tiny, tmp_path, entry):
    path = _damaged(tmp_path, b"GGML" + tiny[1][4:])
    _raises(path, entry, r"not a GGUF file \(magic b'GGML', expected b'GGUF'\)")


def test_unsupported_version(tiny, tmp_path):
    data = bytearray(tiny[1])
    data[4:8] = struct.pack(">I", 3)  # a big-endian file
    path = _damaged(tmp_path, bytes(data))
    _raises(path, "load_model", r"GGUF version 50331648; expected 2 or 3")


def test_tensor_offset_past_end(tiny, tmp_path, entry):
    """A corrupt offset field (numpy would say 'offset must be non-negative ...')."""
    _, data, _, reader = tiny
    name = "blk.0.attn_v.weight"
    t = _tensor(reader, name)
    off_pos = _info_pos(data, name) + 4 + 8 * len(t.shape) + 4
    data = bytearray(data)
    data[off_pos:off_pos + 8] = struct.pack("<Q", 2**62)
    path = _damaged(tmp_path, bytes(data))
    _raises(path, entry, rf"tensor '{re.escape(name)}' .* needs bytes \[{2**62 + int(reader.data_offset)}, \d+\)")


def test_corrupt_string_length(tiny, tmp_path, entry):
    """A metadata key whose length field is garbage must not read past the end or allocate it."""
    data = bytearray(tiny[1])
    data[24:32] = struct.pack("<Q", 2**60)
    path = _damaged(tmp_path, bytes(data))
    _raises(path, entry, rf"metadata entry 1 of \d+ needs bytes \[32, {32 + 2**60}\) but the file has {len(data)} bytes")


def test_corrupt_array_count(tiny, tmp_path, entry):
    data = bytearray(tiny[1])
    key = b"tokenizer.ggml.token_type"
    count_pos = data.find(key) + len(key) + 4 + 4  # value type, then item type, then count
    data[count_pos:count_pos + 8] = struct.pack("<Q", 2**40)
    path = _damaged(tmp_path, bytes(data))
    _raises(path, entry, r"metadata key 'tokenizer\.ggml\.token_type' .* needs bytes")


def test_corrupt_dims_count(tiny, tmp_path, entry):
    data = bytearray(tiny[1])
    name = "blk.0.ffn_gate.weight"
    pos = _info_pos(bytes(data), name)
    data[pos:pos + 4] = struct.pack("<I", 70000)
    path = _damaged(tmp_path, bytes(data))
    _raises(path, entry, rf"tensor info for '{re.escape(name)}' .* has 70000 dimensions; expected at most 4")
