"""What every published drafter directory shares (Medusa, the MLP speculator, the MTP module): a
``config.json`` read leniently (a directory is probed before it is loaded) and the storage dtypes an
export may write, by the names ``torch_dtype`` records."""

from __future__ import annotations

import json
import os
from typing import Optional

import ml_dtypes
import numpy as np

from confu_jax import storage

STORE_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
                "float16": np.dtype(np.float16)}


def read_config_json(directory: str) -> Optional[dict]:
    """``directory/config.json`` as a dict, or None when it is missing, unreadable or not an object."""
    path = os.path.join(directory, "config.json")
    if not storage.isfile(path):
        return None
    try:
        with storage.open(path) as f:
            c = json.load(f)
    except (OSError, ValueError):
        return None
    return c if isinstance(c, dict) else None


def store_dtype(name: str) -> np.dtype:
    """The numpy dtype of an export's ``--dtype`` name (float32, bfloat16 or float16)."""
    if name not in STORE_DTYPES:
        raise ValueError(f"dtype {name!r}: expected one of {sorted(STORE_DTYPES)}")
    return STORE_DTYPES[name]


def dtype_name(dtype) -> str:
    """The ``torch_dtype`` name of a storage dtype (float32, bfloat16 or float16)."""
    for name, dt in STORE_DTYPES.items():
        if np.dtype(dtype) == dt:
            return name
    raise ValueError(f"dtype {dtype!r}: expected float32, float16 or bfloat16")
