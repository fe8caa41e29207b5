"""The package's layers import downward only: no import cycle between subpackages, and the
specific directions docs/DESIGN.md §2 promises (models never imports decode, decode never imports
train, kernels never imports models). Read from the source (AST), so lazy imports inside
functions count too. Also: no module imports another module's private names."""

from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[2] / "confu_jax"


def _unit(module: str) -> str:
    """'confu_jax.models.draft' -> 'models'; root modules ('confu_jax.sharding') are their own unit."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "confu_jax"


def _imports():
    """[(importing module, imported module, imported names)] for every confu_jax import."""
    out = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        mod = ".".join(p for p in rel.parts if p != "__init__")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("confu_jax"):
                names = [a.name for a in node.names]
                # 'from confu_jax.decode import tree' imports the module confu_jax.decode.tree
                subs = [f"{node.module}.{n}" for n in names if (PKG.parent / f"{node.module}.{n}".replace(".", "/")).with_suffix(".py").exists()]
                for target in subs or [node.module]:
                    out.append((mod, target, [] if subs else names))
            elif isinstance(node, ast.Import):
                out.extend((mod, a.name, []) for a in node.names if a.name.startswith("confu_jax"))
    return out


def _graph():
    g: dict = {}
    for src, dst, _ in _imports():
        a, b = _unit(src), _unit(dst)
        if a != b:
            g.setdefault(a, set()).add(b)
    return g


def _find_cycle(g):
    color, stack = {}, []

    def visit(n):
        color[n] = 1
        stack.append(n)
        for m in sorted(g.get(n, ())):
            if color.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if not color.get(m):
                c = visit(m)
                if c:
                    return c
        stack.pop()
        color[n] = 2
        return None

    for n in sorted(g):
        if not color.get(n):
            c = visit(n)
            if c:
                return c
    return None


def test_no_import_cycle_between_subpackages():
    g = _graph()
    assert set(g) >= {"models", "decode", "train"}, g  # the scan sees the package
    assert _find_cycle(g) is None, f"import cycle: {' -> '.join(_find_cycle(g))}"


@pytest.mark.slow
@pytest.mark.parametrize("low,high", [("models", "decode"), ("models", "train"), ("models", "bench"),
                                      ("kernels", "models"), ("decode", "train"), ("train", "decode"), ("decode", "bench"),
                                      ("runs", "train"), ("runs", "decode"), ("weights", "train"),
                                      ("data", "train"), ("decode", "catalog"), ("train", "catalog"),
                                      ("runs", "catalog"), ("models", "catalog")])
def test_lower_layer_never_imports_a_higher_one(low, high):
    bad = [(s, d) for s, d, _ in _imports() if _unit(s) == low and _unit(d) == high]
    assert not bad, f"{low} imports {high}: {bad}"


def test_no_module_path_in_a_string():
    """Every edge between the package's modules is an import this file sees: no ``'confu_jax.x.y:fn'``
    (or ``'confu_jax.x.y'``) string constant names a module to import at run time."""
    import re

    pat = re.compile(r"^(confu_jax(?:\.\w+)+)(:\w+)?$")

    def names_a_module(text):  # format tags such as 'confu_jax.data_release' name no module
        m = pat.match(text)
        if not m:
            return False
        rel = PKG.parent / m.group(1).replace(".", "/")
        return bool(m.group(2)) or rel.with_suffix(".py").exists() or (rel / "__init__.py").exists()

    bad = [(str(path.relative_to(PKG.parent)), node.value) for path in sorted(PKG.rglob("*.py"))
           for node in ast.walk(ast.parse(path.read_text(), str(path)))
           if isinstance(node, ast.Constant) and isinstance(node.value, str) and names_a_module(node.value)]
    assert not bad, bad
    assert names_a_module("confu_jax.train.medusa_task:build_task") and names_a_module("confu_jax.train.loop")


def test_no_private_names_imported_across_modules():
    bad = [(s, d, n) for s, d, names in _imports() for n in names if n.startswith("_") and s != d]
    assert not bad, bad


SUBPACKAGES = sorted(p.parent.name for p in PKG.glob("*/__init__.py"))


@pytest.mark.parametrize("unit", SUBPACKAGES)
def test_no_import_cycle_between_modules_of_a_layer(unit):
    """Module by module (lazy imports included), in every subpackage: e.g. what a saved head is
    (runs.heads) reads the checkpoint and export formats, which never read them back; the
    benchmark's prompt sources share one question type (bench.question) below them."""
    g: dict = {}
    for src, dst, _ in _imports():
        if _unit(src) == _unit(dst) == unit and src != dst:
            g.setdefault(src, set()).add(dst)
    assert _find_cycle(g) is None, f"import cycle: {' -> '.join(_find_cycle(g))}"


def test_every_subpackage_is_checked():
    assert set(SUBPACKAGES) >= {"bench", "catalog", "data", "decode", "kernels", "models", "runs", "train", "weights"}


def test_the_scan_detects_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": {"c"}}) is None
