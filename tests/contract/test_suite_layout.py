"""The suite's own layout (docs/install.md "Running the tests"): every test module sits in one of the four
groups, shared code is imported from ``tests.helpers`` one way only, and no test module imports another
(a module imported under two names loads twice, with two copies of its state)."""

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parents[1]
GROUPS = ("unit", "contract", "e2e", "compile")
HELPERS = {p.stem for p in (TESTS / "helpers").glob("*.py") if p.stem != "__init__"}


def _test_modules():
    return sorted(TESTS.rglob("test_*.py"))


def test_every_test_module_is_in_one_group():
    stray = [str(p.relative_to(TESTS)) for p in _test_modules() if p.parent.name not in GROUPS]
    assert not stray, f"test modules outside tests/{{{','.join(GROUPS)}}}/: {stray}"
    names = [p.name for p in _test_modules()]
    assert len(names) == len(set(names)), "two test modules share a file name (pytest imports them by it)"
    assert {p.parent.name for p in _test_modules()} == set(GROUPS)


def test_shared_code_is_imported_from_tests_helpers_only():
    bad = []
    for path in _test_modules() + sorted((TESTS / "helpers").glob("*.py")) + [TESTS / "conftest.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            else:
                continue
            for mod in mods:
                top = mod.split(".")
                if top[0] in HELPERS or top[0].startswith("test_"):
                    bad.append(f"{path.relative_to(TESTS)}: import {mod} (expected tests.helpers.{top[0]})")
                elif top[0] == "tests" and len(top) > 1 and top[1] != "helpers":
                    bad.append(f"{path.relative_to(TESTS)}: import {mod} (a test module, or not under tests.helpers)")
    assert not bad, "\n".join(bad)
