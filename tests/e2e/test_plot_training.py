"""launch.plot_training: equal-budget alignment of runs, resumed-run duplicates, bad CSVs named."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "launch.plot_training", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def _workdir(path, rows, eval_rows=()):
    os.makedirs(path)
    header = "step,acc/step0,acceptance_length,loss\n"
    with open(os.path.join(path, "metrics.csv"), "w") as f:
        f.write(header + "".join(rows))
    if eval_rows:
        with open(os.path.join(path, "eval.csv"), "w") as f:
            f.write(header.replace("\n", ",decode_tau/chain3\n") + "".join(eval_rows))
    return str(path)


def test_offset_run_lines_up_and_resumed_steps_keep_the_later_row(tmp_path):
    base = _workdir(tmp_path / "e3", ["5,0.1,1.1,9.0\n", "10,0.2,1.2,8.0\n"], ["10,0.15,1.15,8.5,1.05\n"])
    # a resumed run logged step 5 twice: the second (after resume) is the one kept
    confu = _workdir(tmp_path / "confu", ["5,0.3,1.3,7.0\n", "5,0.35,1.35,6.5\n"])
    out = tmp_path / "curves.png"
    r = _run(f"--runs=eagle3={base},confu={confu}@10", f"--out={out}", "--every=5")
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("| eagle3") or line.startswith("| confu")]
    assert lines == ["| eagle3 | 5 | 9.000 | 1.100 | 0.100 | – | – | – |",
                     "| eagle3 | 10 | 8.000 | 1.200 | 0.200 | 8.500 | 1.150 | 1.050 |",
                     "| confu | 15 | 6.500 | 1.350 | 0.350 | – | – | – |"]
    assert out.stat().st_size > 1000


def test_malformed_metrics_row_names_file_and_line(tmp_path):
    bad = _workdir(tmp_path / "bad", ["5,0.1,1.1,9.0\n", "oops,0.1,1.1,9.0\n"])
    r = _run(f"--runs=x={bad}", f"--out={tmp_path / 'c.png'}")
    assert r.returncode != 0
    assert "metrics.csv:3" in r.stderr


def test_bad_run_spec_is_a_usage_error(tmp_path):
    r = _run("--runs=nonamehere", f"--out={tmp_path / 'c.png'}")
    assert r.returncode != 0 and "NAME=WORKDIR" in r.stderr


def test_held_out_step_diagnostics_table(tmp_path):
    path = tmp_path / "e3"
    os.makedirs(path)
    with open(path / "metrics.csv", "w") as f:
        f.write("step,acc/step0,acceptance_length,loss\n5,0.1,1.1,9.0\n10,0.2,1.2,8.0\n")
    cols = "cond_acc/step0,cond_acc/step1,cond_acc/step2,dup_rate/step1,dup_rate/step2," \
           "dup_rate_teacher/step1,dup_rate_teacher/step2"
    with open(path / "eval.csv", "w") as f:
        f.write(f"step,loss,{cols}\n5,8.9,0.4,0.3,0.05,0.6,0.9,0.1,0.12\n10,8.4,0.45,0.4,0.2,0.3,0.4,0.1,0.12\n")
    old = _workdir(tmp_path / "old", ["5,0.1,1.1,9.0\n"], ["5,0.1,1.1,9.0,1.0\n"])  # logs none of them
    out = tmp_path / "curves.png"
    r = _run(f"--runs=e3={path},old={old}@100", f"--out={out}", "--every=5")
    assert r.returncode == 0, r.stderr
    table = r.stdout.split("held-out per TTT step")[1].splitlines()
    rows = [line for line in table if line.startswith("| e3") or line.startswith("| old")]
    assert rows == ["| e3 | 5 | r=0: 0.400 / 0.300 / 0.050 | r=1: 0.600 / 0.900 | r=1: 0.100 / 0.120 |",
                    "| e3 | 10 | r=0: 0.450 / 0.400 / 0.200 | r=1: 0.300 / 0.400 | r=1: 0.100 / 0.120 |"]
    assert out.stat().st_size > 1000
