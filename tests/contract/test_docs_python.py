"""The Python examples of the user docs name the package's API as it is: every block parses, every
``from M import N`` in one imports, and every call to an imported function binds to its signature (positional
count and keyword names), so a renamed function or a changed signature breaks this test, not a
reader's first script. Running them needs the embedded model and a compile per program; the loop they
call is checked for every family in ``test_family_contract``."""

import ast
import importlib
import inspect
import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
BLOCKS = [(p.name, i, m.group(1)) for p in sorted(DOCS.glob("*.md"))
          for i, m in enumerate(re.finditer(r"```python\n(.*?)```", p.read_text(), re.S))]


def test_the_docs_have_python_examples():
    assert any(name == "decoding.md" for name, _, _ in BLOCKS), [b[:2] for b in BLOCKS]


@pytest.mark.parametrize("name,index,code", BLOCKS, ids=[f"{n}#{i}" for n, i, _ in BLOCKS])
def test_python_example_imports_and_binds(name, index, code):
    tree = ast.parse(code)
    imported = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{name}: {node.module} has no {alias.name}"
                imported[alias.asname or alias.name] = getattr(module, alias.name)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id in imported and callable(imported[n.func.id])]
    assert calls or not imported, f"{name}: no call to what the example imports"
    for call in calls:
        fn = imported[call.func.id]
        args = [object()] * len(call.args)
        kwargs = {k.arg: object() for k in call.keywords if k.arg is not None}
        try:
            inspect.signature(fn).bind(*args, **kwargs)
        except TypeError as e:
            pytest.fail(f"{name}: {call.func.id}({ast.unparse(call)[len(call.func.id) + 1:-1]}) does not fit "
                        f"{call.func.id}{inspect.signature(fn)}: {e}")
