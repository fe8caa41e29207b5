"""The equal-compute family table (bench/families.py): training cost read from workdirs and logs,
branched runs counted with their parent's share, pass cost and paired τ ratios from decode_bench rows."""

import dataclasses
import json
import os

import pytest

from confu_jax.bench import families


def _workdir(root, method, *, steps, rows=4, length=512, pack=False, wall=None, params=None):
    wd = os.path.join(root, method)
    for s in steps:
        os.makedirs(os.path.join(wd, "checkpoints", str(s)))
    with open(os.path.join(wd, "config.json"), "w") as f:
        json.dump({"data": {"global_batch_size": rows, "max_length": length, "pack": pack}}, f)
    lines = []
    if params is not None:
        lines.append(f"I1126 loop.py:248] task: x | trainable {params:,} params | frozen 1 params")
    if wall is not None:
        lines.append(f"{method} wall {wall} s")
    with open(os.path.join(root, f"{method}.log"), "w") as f:
        f.write("\n".join(lines) + "\n")


def _row(method, per_question, *, wall_s, budget="chain:3", lossless=True):
    """A decode_bench row from {question: (emitted, passes)} (two categories, alternating)."""
    questions = {q: {"category": "writing" if i % 2 else "coding", "emitted": e, "passes": p,
                     "tokens": e, "seconds": wall_s / len(per_question)}
                 for i, (q, (e, p)) in enumerate(per_question.items())}
    emitted, passes = sum(e for e, _ in per_question.values()), sum(p for _, p in per_question.values())
    return {"method": method, "temperature": 0.0, "budget": budget, "tau": emitted / passes, "tau_ci": [1.0, 2.0],
            "speedup": 1.0, "speedup_ci": [0.9, 1.1], "wall_s": wall_s, "n_target_passes": passes,
            "n_questions": len(per_question), "acceptance_rate_per_depth": [0.5, 0.25, 0.125],
            "lossless_greedy": lossless, "questions": questions, "per_category": {}}


def test_training_records_count_the_parent_share(tmp_path):
    root = str(tmp_path)
    _workdir(root, "eagle3", steps=[100, 200], wall=800.0, params=7_448_832)
    _workdir(root, "confu", steps=[100], wall=1000.0, params=9_000_000)
    _workdir(root, "medusa", steps=[100, 200], wall=600.0)
    e3 = families.read_training(root, "eagle3")
    assert (e3.steps, e3.wall_s, e3.trainable_params, e3.row_tokens) == (200, 800.0, 7_448_832, 200 * 4 * 512)
    confu = families.read_training(root, "confu", ("eagle3", 100), {"eagle3": e3})
    # 100 own steps + EAGLE-3's first 100 (half its 800 s)
    assert (confu.steps, confu.wall_s, confu.row_tokens) == (200, 1400.0, e3.row_tokens)
    assert families.read_training(root, "medusa").trainable_params is None  # the log did not say
    at100 = families.read_training(root, "eagle3", at_step=100)  # its step-100 checkpoint, half its wall time
    assert (at100.steps, at100.wall_s, at100.row_tokens) == (100, 400.0, 100 * 4 * 512)
    with pytest.raises(FileNotFoundError, match="step 150"):
        families.read_training(root, "eagle3", at_step=150)


def test_training_records_refuse_packed_rows_and_a_missing_parent(tmp_path):
    root = str(tmp_path)
    _workdir(root, "mtp", steps=[10], pack=True)
    with pytest.raises(ValueError, match="packed rows"):
        families.read_training(root, "mtp")
    _workdir(root, "confu", steps=[10])
    with pytest.raises(ValueError, match="'eagle3'"):
        families.read_training(root, "confu", ("eagle3", 10), {})
    with pytest.raises(FileNotFoundError, match="checkpoints"):
        families.read_training(root, "nothing_here")


def _records(steps=(200, 200)):
    return [families.TrainingRecord(method=m, steps=s, rows=4, length=512, wall_s=60.0, trainable_params=None)
            for m, s in zip(("eagle3", "medusa"), steps)]


def _bench():
    ar = _row("ar", {"q0": (10, 10), "q1": (20, 20), "q2": (30, 30)}, wall_s=6.0)  # 0.1 s a step
    e3 = _row("eagle3", {"q0": (12, 10), "q1": (30, 20), "q2": (36, 30)}, wall_s=12.0)  # 60 passes, 0.2 s each
    medusa = _row("medusa", {"q0": (15, 10), "q1": (30, 20), "q2": (45, 30)}, wall_s=9.0)  # 0.15 s each
    return [ar, e3, medusa]


def test_comparison_pass_cost_and_paired_ratio():
    rows = families.comparison(_records(), _bench(), _bench(), n_boot=200)
    e3, medusa = rows
    for b in ("mtbench", "heldout"):
        assert e3[b]["pass_cost"] == pytest.approx(2.0)  # 0.2 s a pass over 0.1 s an AR step
        assert medusa[b]["pass_cost"] == pytest.approx(1.5)
        assert "tau_ratio" not in e3[b]
        # τ medusa = 90/60 = 1.5, τ eagle3 = 78/60 = 1.3
        assert medusa[b]["tau_ratio"] == pytest.approx(1.5 / 1.3)
        lo, hi = medusa[b]["tau_ratio_ci"]
        assert lo <= medusa[b]["tau_ratio"] <= hi
    table = families.markdown(rows)
    lines = [ln for ln in table.splitlines() if ln.startswith("| ") and "---" not in ln]
    assert [ln.split(" | ")[0] for ln in lines[1:]] == ["| eagle3", "| medusa"]
    assert "| 1.50 |" in lines[2] and "0.50 / 0.25 / 0.12" in lines[2]


def test_comparison_refuses_unequal_budgets_and_missing_rows():
    with pytest.raises(ValueError, match="different token budgets"):
        families.comparison(_records(steps=(200, 100)), _bench(), _bench())
    no_ar = [r for r in _bench() if r["method"] != "ar"]
    with pytest.raises(ValueError, match="'ar' row"):
        families.comparison(_records(), _bench(), no_ar)
    no_medusa = [r for r in _bench() if r["method"] != "medusa"]
    with pytest.raises(ValueError, match="no row for method 'medusa'"):
        families.comparison(_records(), no_medusa, _bench())


def test_plot_writes_a_png(tmp_path):
    path = str(tmp_path / "f.png")
    families.plot(families.comparison(_records(), _bench(), _bench(), n_boot=50), path)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def _at(row, temperature, budget):
    return {**row, "temperature": temperature, "budget": budget}


def test_grid_pairs_within_set_temperature_and_plan_kind_across_runs():
    """A line per (set, T, family, plan); pass cost against its own run's AR at its T; τ ratios against the
    reference's line of the same kind, a renamed head from a second run included (EAGLE 3.1 as eagle3)."""
    main = [_at(r, t, b) for t in (0.0, 1.0) for r, b in zip(_bench(), ("–", "chain:3", "chain:3"))]
    main += [_at(_row("eagle3", {"q0": (13, 10), "q1": (26, 20), "q2": (39, 30)}, wall_s=18.0), 0.0, "dynamic:3,4,8"),
             _at(_row("medusa", {"q0": (20, 10), "q1": (40, 20), "q2": (60, 30)}, wall_s=12.0), 0.0, "ddtree:8,3")]
    second_ar = _row("ar", {"q0": (10, 10), "q1": (20, 20), "q2": (30, 30)}, wall_s=3.0)  # 0.05 s a step
    second = [second_ar, _row("eagle3", {"q0": (11, 10), "q1": (22, 20), "q2": (33, 30)}, wall_s=6.0)]
    records = [families.TrainingRecord(method=m, steps=100, rows=4, length=512, wall_s=60.0, trainable_params=None)
               for m in ("eagle3", "eagle31", "medusa")]
    lines = families.grid(records, {"mtbench": [(main, {}), (second, {"eagle3": "eagle31"})]}, n_boot=100)
    key = {(ln["temperature"], ln["method"], ln["budget"]): ln for ln in lines}
    assert set(key) == {(0.0, "eagle3", "chain:3"), (0.0, "eagle3", "dynamic:3,4,8"), (0.0, "eagle31", "chain:3"),
                        (0.0, "medusa", "chain:3"), (0.0, "medusa", "ddtree:8,3"), (1.0, "eagle3", "chain:3"),
                        (1.0, "medusa", "chain:3")}
    assert [(ln["temperature"], ln["method"], ln["kind"]) for ln in lines][:4] == [
        (0.0, "eagle3", "chain"), (0.0, "eagle3", "tree"), (0.0, "eagle31", "chain"), (0.0, "medusa", "chain")]
    assert key[(0.0, "eagle31", "chain:3")]["pass_cost"] == pytest.approx(2.0)  # its own run's AR: 0.1 / 0.05
    assert key[(0.0, "eagle31", "chain:3")]["tau_ratio"] == pytest.approx(66 / 78)  # against eagle3's chain
    assert key[(0.0, "medusa", "ddtree:8,3")]["tau_ratio"] == pytest.approx(2.0 / 1.3)  # against eagle3's tree
    assert key[(1.0, "medusa", "chain:3")]["tau_ratio"] == pytest.approx(1.5 / 1.3)
    assert "tau_ratio" not in key[(0.0, "eagle3", "dynamic:3,4,8")]
    table = families.grid_markdown(lines)
    assert table.count("\n") == 2 + len(lines)
    assert "| mtbench | 0 | medusa | ddtree:8,3 | 2.00 [1.00, 2.00] | 1.538" in table
    assert "| eagle3 | – | 100 (205k) | 1.0 min |" in families.training_markdown(records[:1])


def test_grid_refuses_a_missing_family_or_baseline():
    records = [families.TrainingRecord(method=m, steps=100, rows=4, length=512, wall_s=None, trainable_params=None)
               for m in ("eagle3", "medusa")]
    with pytest.raises(ValueError, match=r"no row for \['medusa'\]"):
        families.grid(records, {"grounded": [([r for r in _bench() if r["method"] != "medusa"], {})]})
    with pytest.raises(ValueError, match="'ar' row at T=0"):
        families.grid(records, {"grounded": [([r for r in _bench() if r["method"] != "ar"], {})]})
    with pytest.raises(ValueError, match="different token budgets"):
        families.grid([records[0], dataclasses.replace(records[1], steps=50)], {"s": [(_bench(), {})]})


def test_cli_writes_the_grid_from_result_files(tmp_path):
    """launch.families_table --results SET=FILE[:METHOD=NAME]: the renamed second run joins the grid."""
    import subprocess
    import sys

    root = str(tmp_path)
    for m in ("eagle3", "eagle31", "medusa"):
        _workdir(root, m, steps=[100], wall=120.0, params=1_000_000)
    main, second = tmp_path / "main.json", tmp_path / "second.json"
    main.write_text(json.dumps({"results": _bench()}))
    second.write_text(json.dumps({"results": [_bench()[0], _bench()[1]]}))
    out = str(tmp_path / "grid")
    cmd = [sys.executable, "-m", "launch.families_table", "--runs", root, "--methods", "eagle3,eagle31,medusa",
           "--results", f"mtbench={main}", "--results", f"mtbench={second}:eagle3=eagle31", "--out", out]
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=repo)
    assert done.returncode == 0, done.stderr[-2000:]
    grid = json.load(open(out + ".json"))["grid"]
    assert [(g["method"], g["tau_ratio"] if "tau_ratio" in g else None) for g in grid] == [
        ("eagle3", None), ("eagle31", 1.0), ("medusa", pytest.approx(1.5 / 1.3))]
    # the first --results kept, --mtbench beside it
    bad = subprocess.run(cmd[:-4] + ["--mtbench", str(main)], capture_output=True, text=True, cwd=repo)
    assert bad.returncode != 0 and "expected either --mtbench and --heldout, or --results" in bad.stderr
    # a later table of new families beside these: the records of heads whose workdirs are gone come from this
    # table's JSON, exactly as they were read
    first = json.load(open(out + ".json"))
    earlier = families.read_training_table(out + ".json")
    assert [dataclasses.asdict(earlier[m]) for m in ("eagle3", "eagle31", "medusa")] == first["training"]
    import shutil
    shutil.rmtree(os.path.join(root, "eagle3"))
    os.remove(os.path.join(root, "eagle3.log"))
    with open(os.path.join(root, "medusa.log"), "a") as f:  # a later resumed run: the table's record still wins
        f.write("medusa wall 60.0 s\n")
    later = subprocess.run(cmd[:-2] + ["--training_from", out + ".json", "--out", out + "_later"],
                           capture_output=True, text=True, cwd=repo)
    assert later.returncode == 0, later.stderr[-2000:]
    training = {r["method"]: r for r in json.load(open(out + "_later.json"))["training"]}
    assert training["eagle3"] == first["training"][0] and training["medusa"]["wall_s"] == 120.0
    assert json.load(open(out + "_later.json"))["grid"] == first["grid"]
    with pytest.raises(ValueError, match="expected a launch.families_table JSON with a 'training' list"):
        families.read_training_table(str(main))
