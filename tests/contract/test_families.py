"""The drafter-family registry's contract (``decode.families``), checked for every record: the methods
and the records name each other, every plan a record offers reads back to the same drafter, its
catalog entry's training task and configs agree, its export formats are the CLI's, and what it loads with no
source drafts its default plan. The plan types (``decode.plans``) and acceptance rules are values.
Per-family decoding (greedy = AR, chi-square, sharded, export, resume) lives in each family's tests."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys

import jax
import pytest

from confu_jax import catalog
from confu_jax.decode import families, plans
from confu_jax.decode import verify as verify_lib
from confu_jax.models.presets import get_preset
from confu_jax.decode.families import METHODS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECORDS = sorted(families.FAMILIES)


def _a_method(family: str) -> str:
    return next(name for name, m in METHODS.items() if m.family == family)


def test_every_drafting_method_has_a_record_and_every_record_a_method():
    used = {m.family for m in METHODS.values()}
    assert set(families.FAMILIES) == used - {"ar", "auto"}
    for name, m in METHODS.items():
        if m.family in ("ar", "auto"):
            with pytest.raises(ValueError, match="does not draft"):
                families.family_of(name)
        else:
            assert families.family_of(name) is families.FAMILIES[m.family]


@pytest.mark.parametrize("family", RECORDS)
def test_every_offered_plan_reads_back_to_the_same_drafter(family):
    rec = families.FAMILIES[family]
    for text in (rec.default_plan(),) + rec.chains + rec.trees:
        d = rec.parse(text)
        assert rec.parse(d.describe()) == d, (text, d.describe())
        assert hash(d) == hash(rec.parse(text))  # a static jit argument
    assert rec.chains, "budget auto needs chains to calibrate"


def test_the_catalog_pairs_every_record_with_its_training():
    assert set(catalog.CATALOG) == set(families.FAMILIES)
    for name, e in catalog.CATALOG.items():
        assert e.drafter is families.FAMILIES[name]
        assert e.trains == bool(e.configs) == bool(e.tiny_config), name  # a family trains with configs or not at all
    assert catalog.entry_of("eagle3") is catalog.entry_of("confu") is catalog.CATALOG["head"]
    with pytest.raises(ValueError, match="expected one of"):
        catalog.entry("bogus")


@pytest.mark.parametrize("family", [e.name for e in catalog.training()])
def test_training_task_and_configs_agree(family):
    from confu_jax.train.tasks import TASKS, resolve

    e = catalog.entry(family)
    assert TASKS[family] is e.build_task  # config.train.task is the family's name
    for path in e.configs:
        config = runpy.run_path(os.path.join(REPO, path))["get_config"]()
        assert resolve(config.train.task) is e.build_task, path
    from tests.helpers.train_resume import tiny_run_config

    tiny = tiny_run_config(e.tiny_config)  # the tiny config trains this family, on the tiny target
    assert resolve(tiny.train.task) is e.build_task and tiny.model.preset == "tiny", e.tiny_config


def test_a_task_is_named_by_its_family_or_by_an_importable_function():
    from confu_jax.train.tasks import resolve

    from tests.helpers import toy_task

    assert resolve("tests.helpers.toy_task:build_task") is toy_task.build_task  # a task outside the package
    with pytest.raises(ValueError, match=r"expected one of \['dflash'.*'package.module:function'"):
        resolve("medusa_task")
    with pytest.raises(AttributeError, match="has no 'nope'"):
        resolve("tests.helpers.toy_task:nope")


def test_export_formats_are_the_clis_and_belong_to_one_family_each():
    fmts = families.export_formats()
    assert len(fmts) == len(set(fmts))
    r = subprocess.run([sys.executable, "-m", "launch.export_head", "--workdir", "x", "--format", "bogus"], cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0 and f"<{'|'.join(fmts)}>" in r.stderr, r.stderr[-1000:]


def test_every_export_format_has_one_writer_and_options_the_cli_refuses_elsewhere():
    """Each family's formats are records of ``runs.exports`` (no format without a writer, no writer
    no family offers); a flag a format does not read is one line naming the formats that do."""
    from confu_jax.decode.families import EXPORT_FORMATS

    assert set(families.export_formats()) == set(EXPORT_FORMATS)
    fmt = next(f for f in EXPORT_FORMATS.values() if "mtp_shared" not in f.options)
    r = subprocess.run([sys.executable, "-m", "launch.export_head", "--workdir", "x", "--format", fmt.name, "--out",
                        "y", "--mtp_shared"], cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"),
                       capture_output=True, text=True, timeout=300)
    takers = [n for n, f in EXPORT_FORMATS.items() if "mtp_shared" in f.options]
    assert r.returncode != 0 and f"--mtp_shared is for --format {' / '.join(takers)}, not {fmt.name}" in r.stderr
    assert "Traceback" not in r.stderr, r.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("family", RECORDS)
def test_what_a_family_loads_without_a_source_drafts_its_default_plan(family):
    from confu_jax.models.llama import init_params

    cfg = get_preset("tiny")
    tp = init_params(cfg, jax.random.PRNGKey(0))
    rec = families.FAMILIES[family]
    method = _a_method(family)
    head = families.decode_head(method, cfg, tp, None)
    drafter = rec.parse(rec.default_plan(head.drafter_params))
    limit = rec.max_depth(head.drafter_params) if rec.max_depth else None
    assert limit is None or drafter.max_depth <= limit
    if not rec.reads_step:
        with pytest.raises(ValueError, match="checkpoint step"):
            families.decode_head(method, cfg, tp, "runs/x@3")


def test_plans_are_types_with_their_rule_and_text():
    cases = {"chain:3": (plans.Chain, 3, 4, verify_lib.SAMPLED_TREE),
             "sampled_chain:3": (plans.SampledChain, 3, 4, verify_lib.SAMPLED_CHAIN),
             "tree:2,2": (plans.StaticTree, 2, 7, verify_lib.SAMPLED_TREE),
             "dynamic:4,4,8": (plans.DynamicTree, 4, 9, verify_lib.SAMPLED_TREE),
             "dynamic:6,10,60+c15": (plans.DynamicTree, 6, 61, verify_lib.SAMPLED_TREE)}
    for text, (cls, depth, nodes, rule) in cases.items():
        p = plans.parse_plan(text)
        assert type(p) is cls and p.max_depth == depth and p.n_nodes_total == nodes and p.text == text
        assert p.rule(False) == rule and p.rule(True) == verify_lib.GREEDY
        assert p.structure().n_nodes == nodes if cls is not plans.DynamicTree else not p.nodes_ranked
    assert plans.parse_plan("chain:3") != plans.parse_plan("sampled_chain:3")
    assert plans.StaticTree(((0,), (1,), (0, 0))).text == "static:[(0,), (1,), (0, 0)]"
    with pytest.raises(ValueError, match="Medusa has no contemplates"):
        plans.parse_plan("chain:3+c2", what="Medusa")


def test_auto_candidates_per_family_or_for_all():
    from confu_jax.bench.cli_args import parse_auto_candidates

    assert parse_auto_candidates("chain:2,dynamic:4,4,8") == {None: ("chain:2", "dynamic:4,4,8")}
    assert parse_auto_candidates("head=chain:2,dynamic:4,4,8;lookup=chain:2,lookup:4,2") == {
        "head": ("chain:2", "dynamic:4,4,8"), "lookup": ("chain:2", "lookup:4,2")}
    with pytest.raises(ValueError, match="FAMILY=PLAN"):
        parse_auto_candidates("heads=chain:2")
