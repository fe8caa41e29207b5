"""What a new user reads: one line per bad-record reason (the full list in the run directory), no
orbax chatter or read-only warnings from training, resuming and init_from, no progress-bar redraws
in logs."""

import json
import pytest
import logging
import os
import subprocess
import sys

from confu_jax.data import formats
from tests.helpers.xla_env import SINGLE_DEVICE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOY = os.path.join(REPO, "tests", "configs", "toy_train.py")

GOOD = {"conversations": [{"from": "human", "value": "Hello, how are you today?"},
                          {"from": "gpt", "value": "Fine, thank you for asking; here is a longer answer."}]}
BAD = {4: "{not json", 11: json.dumps({"conversations": []}), 21: "{also not json",
       26: json.dumps({"conversations": [{"from": "alien", "value": "x"}, {"from": "gpt", "value": "y"}]})}


def _data(path, n_good=40):
    lines = [json.dumps({"id": f"g{i}", **GOOD}) for i in range(n_good)]
    for line_no in sorted(BAD):  # 1-based file lines
        lines.insert(line_no - 1, BAD[line_no])
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _env():
    return dict(os.environ, XLA_FLAGS=SINGLE_DEVICE, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")


def test_bad_records_one_line_per_reason_and_every_record_in_the_log(tmp_path, caplog):
    data = _data(tmp_path / "d.jsonl")
    log_path = str(tmp_path / "run" / "bad_records.log")
    with caplog.at_level(logging.WARNING, logger="confu_jax.data.formats"), formats.bad_records_log_to(log_path):
        convs, report = formats.load_conversations([data])
    assert len(convs) == 40 and report.n_bad == 4
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == f"d.jsonl: 4 bad records skipped (every one in {log_path})"
    per_reason = lines[1:]
    assert len(per_reason) == 3  # one per reason, most frequent first, with its first file:line
    assert per_reason[0].split() == ["2", "invalid_json", "(first:", f"{data}:4)"]
    assert {ln.split()[1] for ln in per_reason} == {"invalid_json", "no_conversation", "unknown_role"}
    listed = open(log_path).read().splitlines()
    assert [ln.split(": ")[0] for ln in listed] == [f"{data}:{n}" for n in sorted(BAD)]
    assert [ln.split(": ")[1] for ln in listed] == ["invalid_json", "no_conversation", "invalid_json", "unknown_role"]
    # a second block starts a fresh list (a resumed run reads the same records again)
    with formats.bad_records_log_to(log_path):
        formats.load_conversations([data])
    assert len(open(log_path).read().splitlines()) == 4


def test_without_a_log_file_at_most_three_records_are_listed(tmp_path, caplog):
    data = _data(tmp_path / "d.jsonl")
    with caplog.at_level(logging.WARNING, logger="confu_jax.data.formats"):
        formats.load_conversations([data])
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "d.jsonl: 4 bad records skipped (first 3 below)"
    assert len(lines) == 1 + 3 + 3 and lines[-1].strip().startswith(f"{data}:21: invalid_json")


@pytest.mark.slow
def test_training_cli_writes_the_bad_record_list_to_its_workdir(tmp_path):
    """The SmolLM2 EAGLE-3 config on a small file with four bad records (0 steps: data, draft
    vocabulary, target and state are all set up, nothing is trained)."""
    data = _data(tmp_path / "d.jsonl")
    work = tmp_path / "w"
    p = subprocess.run([sys.executable, "-m", "launch.train", "--config", "configs/smollm2_eagle3.py",
                        "--workdir", str(work), f"--config.data.train_files={data}", "--config.train.steps=0",
                        "--config.train.eval_every=0", "--config.draft.draft_vocab_size=64",
                        "--config.data.global_batch_size=2", "--config.data.max_length=64",
                        "--config.objective.eval_records=2"],
                       cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "4 bad records skipped (every one in" in p.stderr
    assert sum("(first: " in ln for ln in p.stderr.splitlines()) == 3
    assert len(open(work / "bad_records.log").read().splitlines()) == 4


def _train(*args):
    return subprocess.run([sys.executable, "-m", "launch.train", "--config", TOY, *args], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_training_resume_and_init_from_print_no_orbax_chatter(tmp_path):
    src, dst = str(tmp_path / "a"), str(tmp_path / "b")
    runs = [_train("--workdir", src, "--config.train.steps=3", "--config.train.eval_every=0"),
            _train("--workdir", src, "--config.train.steps=5", "--config.train.eval_every=0"),  # resume
            _train("--workdir", dst, "--config.train.steps=2", "--config.train.eval_every=0",
                   f"--config.train.checkpoint.init_from={os.path.join(src, 'checkpoints')}")]  # read-only open
    for p in runs:
        assert p.returncode == 0, p.stderr[-3000:]
        out = p.stderr + p.stdout
        assert "read only" not in out
        orbax_lines = [ln for ln in out.splitlines() if "checkpoint_manager.py" in ln or "orbax" in ln.lower()]
        assert orbax_lines == [], orbax_lines[:5]
        assert "\r" not in out  # no progress-bar redraws when stderr is not a terminal
        assert "Unable to initialize backend 'tpu'" not in out
    assert "resumed from" in runs[1].stderr and "compiled train step" in runs[1].stderr  # our own lines stay


def test_a_long_phase_prints_a_plain_line_in_a_log_and_nothing_when_short(capsys):
    """Where stderr is not a terminal (pytest captures it), ``progress.phase`` draws no bar; a phase
    that outlasts ``log_every_s`` prints one plain line per period (a long compile in a CI log is
    never silent), a short one prints nothing, and ``enabled=False`` silences it."""
    import time

    from confu_jax import progress

    with progress.phase("compiling x", log_every_s=0.1):
        time.sleep(0.35)
    lines = capsys.readouterr().err.splitlines()
    assert 2 <= len(lines) <= 4 and all(line.startswith("compiling x: still running (") for line in lines), lines
    with progress.phase("compiling y", log_every_s=5.0):
        time.sleep(0.05)
    with progress.phase("compiling z", enabled=False, log_every_s=0.05):
        time.sleep(0.2)
    assert capsys.readouterr().err == ""
