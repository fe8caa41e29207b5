"""Tensor files as the ecosystem writes them, read and written by name: ``model.safetensors`` (single or
sharded through its index) and ``pytorch_model.bin`` (through torch's ``weights_only`` loader), float,
integer and bool tensors alike (a head's d2t / t2d maps are int64 / bool). Every published-layout module
of ``confu_jax.weights`` reads and writes through here; ``safetensors_io`` is the byte-level format."""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

from confu_jax import storage
from confu_jax.weights import packed_files
from confu_jax.weights.errors import CheckpointError
from confu_jax.weights.safetensors_io import FLOAT_DTYPES, RemoteTensor, SafetensorsFile

_INT_TAGS = {"I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
             "U8": np.dtype("u1"), "BOOL": np.dtype(bool)}
_ALL_TAGS = {**FLOAT_DTYPES, **_INT_TAGS}
_TAG_OF = {v: k for k, v in _ALL_TAGS.items()}


def read_tensors(directory: str) -> dict:
    """name -> numpy array from model.safetensors (or the xz-packed ``model.safetensors.xz`` a head
    release stores: ``weights.packed_files``), its sharded index, or pytorch_model.bin (+ index)."""
    for name, reader in (("model.safetensors", _read_safetensors), ("pytorch_model.bin", load_torch_pickle)):
        single, index = os.path.join(directory, name), os.path.join(directory, f"{name}.index.json")
        if packed_files.exists(single):
            return reader(packed_files.local(single))
        if storage.isfile(index):  # sharded: every shard its index names
            out = {}
            for shard in _shards(index):
                out.update(reader(os.path.join(directory, shard)))
            return out
    raise CheckpointError(f"{directory}: expected model.safetensors, model.safetensors.index.json or "
                          f"pytorch_model.bin; found {sorted(storage.listdir(directory))[:12]}")


def _shards(index: str) -> list:
    with storage.open(index) as f:
        wm = json.load(f).get("weight_map")
    if not isinstance(wm, dict):
        raise CheckpointError(f"{index}: no 'weight_map' object")
    shards = sorted(set(wm.values()))
    for s in shards:
        if not storage.isfile(os.path.join(os.path.dirname(index), s)):
            raise CheckpointError(f"{index}: shard {s!r} listed in weight_map is missing")
    return shards


def _read_safetensors(path: str) -> dict:
    sf = SafetensorsFile(path)
    data_start = sf.data_start
    out = {}
    for name in sf.names():
        tag, shape = sf.info(name)
        if tag in FLOAT_DTYPES:
            out[name] = sf.get(name)
        elif tag in _INT_TAGS:
            begin, end = sf.header[name]["data_offsets"]
            dt = _INT_TAGS[tag]
            if end - begin != int(np.prod(shape, dtype=np.int64)) * dt.itemsize:
                raise CheckpointError(f"{path}: tensor {name!r} spans {end - begin} bytes; shape {shape} x {tag} "
                                      "does not")
            out[name] = (RemoteTensor(path, dt, data_start + begin, tuple(shape)) if storage.is_remote(path) else
                         np.memmap(path, dtype=dt, mode="r", offset=data_start + begin, shape=tuple(shape)))
        else:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {tag}; expected one of {sorted(_ALL_TAGS)}")
    return out


def load_torch_pickle(path: str) -> dict:
    """A ``torch.save``d state dict through torch's ``weights_only`` loader, never a plain unpickle:
    a pickle may name any callable, and unpickling calls it. bfloat16 tensors keep their bits."""
    try:
        import torch
    except ImportError:
        raise CheckpointError(f"{path}: reading a pytorch_model.bin needs torch (its safe weights_only "
                              "loader); install torch, or convert the file to model.safetensors") from None
    import pickle

    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path}: refused: the pickle names code or objects beyond plain tensors, which "
            f"torch's weights_only loader will not run (we never unpickle with code). Details: "
            f"{str(e).splitlines()[0]}") from None
    except Exception as e:  # a truncated or foreign file
        raise CheckpointError(f"{path}: not a readable torch state dict: {type(e).__name__}: {e}") from None
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise CheckpointError(f"{path}: expected a dict of tensor name -> tensor, found {type(sd).__name__}")
    out = {}
    for k, t in sd.items():
        t = t.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            out[k] = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        else:
            out[k] = t.numpy()
    return out


def save_safetensors(tensors: dict, path: str) -> None:
    """safetensors writer for float (incl. bfloat16), integer and bool arrays (d2t, t2d)."""
    header, offset, order = {}, 0, []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in _TAG_OF:
            raise CheckpointError(f"save {path}: tensor {name!r} has dtype {arr.dtype}; expected one of "
                                  f"{sorted(str(d) for d in _TAG_OF)}")
        arr = arr.astype(arr.dtype.newbyteorder("<")) if arr.dtype.byteorder == ">" else arr
        header[name] = {"dtype": _TAG_OF[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        order.append(arr)
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = f"{path}.{os.getpid()}.tmp"  # a new file, renamed over: memory maps of the old one stay valid
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in order:
            f.write(arr.tobytes())
    os.replace(tmp, path)
