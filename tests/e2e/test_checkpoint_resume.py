"""Checkpoints: exact save/restore, keep-N, atomicity, init_from, and runs that are killed.

The killed-run tests compare against an uninterrupted run of the same config: same mesh, same
compiled program, so the loss trajectory must agree to the last bit (asserted to 1e-6).
"""

import json
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax import sharding as shd
from confu_jax.runs.checkpoint import Checkpointer, init_params_from
from confu_jax.train.loop import setup_run, train
from confu_jax.train.metric_writers import read_csv
from tests.helpers.toy_task import get_toy_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOY_CONFIG = os.path.join(REPO, "tests", "configs", "toy_train.py")
# Everything the runs below change from the toy config, as CLI overrides and as a dict.
OVERRIDES = {"train.mesh.fsdp": 2, "train.mesh.tensor": 2, "train.steps": 12,
             "train.checkpoint.every": 3, "train.eval_every": 4, "train.progress_bar": False}


def _config(**extra):
    c = get_toy_config()
    for key, value in {**OVERRIDES, **extra}.items():
        node = c
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return c


def _host(tree):
    return jax.tree_util.tree_map(lambda x: np.array(x), jax.device_get(tree))


def _assert_trees_equal(a, b):
    fa, fb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_leaves(b)
    assert len(fa) == len(fb)
    for (path, x), y in zip(fa, fb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=shd.path_str(path))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: 12 steps, checkpoints every 3, eval every 4."""
    workdir = str(tmp_path_factory.mktemp("reference"))
    result = train(_config(), workdir)
    assert result.step == 12 and not result.preempted
    return read_csv(os.path.join(workdir, "metrics.csv")), read_csv(os.path.join(workdir, "eval.csv"))


def _assert_same_trajectory(rows, ref_rows):
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows]  # no gaps, no duplicates
    for r, q in zip(rows, ref_rows):
        for k in q:
            np.testing.assert_allclose(r[k], q[k], rtol=1e-6, atol=0, err_msg=f"step {q['step']} {k}")


# ----------------------------------------------------------------------------- unit level


def test_save_restore_is_exact_including_shardings_data_and_extras(tmp_path):
    run = setup_run(_config())
    state = run.init_state()
    # non-trivial optimizer moments, step and RNG without compiling a whole train step

    @jax.jit
    def advance(state):
        grads = jax.tree_util.tree_map(lambda p: jnp.full_like(p, 0.1), state.params)
        _, opt_state = run.tx.update(grads, state.opt_state, state.params)
        return state.replace(step=state.step + 2, opt_state=opt_state,
                             rng=jax.random.split(state.rng)[0])

    state = jax.device_put(advance(state), run.state_shardings)
    extras = {"d2t": np.arange(7, dtype=np.int32) * 3, "t2d": np.arange(21) % 3 == 0}
    ck = Checkpointer(str(tmp_path / "ck"), every=1, keep=3)
    assert ck.save(2, state, {"position": 17, "epoch": [1, 2]}, extras)
    ck.save(3, state, b"\x00grain-bytes\xff", extras)
    ck.wait()
    r = ck.restore(run.sharded_abstract_state(), step=2, extras_like=extras)
    _assert_trees_equal(_host(r.state), _host(state))
    for a, b in zip(jax.tree_util.tree_leaves(r.state), jax.tree_util.tree_leaves(state)):
        assert a.sharding == b.sharding  # restored straight into the run's shardings
    assert r.data_state == {"position": 17, "epoch": [1, 2]}
    assert r.extras.keys() == extras.keys()
    for k in extras:
        np.testing.assert_array_equal(r.extras[k], extras[k])
        assert np.asarray(r.extras[k]).dtype == extras[k].dtype
    assert ck.restore(run.sharded_abstract_state()).data_state == b"\x00grain-bytes\xff"
    ck.close()


def test_keep_n_and_incomplete_checkpoints_are_ignored(tmp_path):
    state = {"w": jnp.arange(6.0)}
    ck = Checkpointer(str(tmp_path), every=2, keep=2)
    for s in range(1, 8):
        ck.save(s, state, {"position": s})
    ck.wait()
    assert ck.all_steps() == [4, 6]  # every 2, keep the newest 2
    ck.close()
    # a save that died mid-write: orbax's temporary directory, never renamed into place
    partial = tmp_path / "8.orbax-checkpoint-tmp"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "garbage").write_bytes(b"\x00" * 10)
    ck = Checkpointer(str(tmp_path), every=2, keep=2)
    assert ck.latest_step() == 6
    assert not partial.exists()  # cleaned up when the run reopens its directory
    restored = ck.restore({"w": jax.ShapeDtypeStruct((6,), jnp.float32)})
    np.testing.assert_array_equal(restored.state["w"], np.arange(6.0))
    assert restored.data_state == {"position": 6}
    ck.close()


def test_milestones_are_saved_and_never_pruned(tmp_path):
    state = {"w": jnp.arange(6.0)}
    ck = Checkpointer(str(tmp_path), every=4, keep=2, async_save=False, milestones=(1, 3, 6))
    for s in range(1, 15):
        ck.save(s, state, {"position": s})
    ck.wait()
    # saved: the milestones and every 4th step; kept: the milestones and the newest 2 (4 pruned)
    assert ck.all_steps() == [1, 3, 6, 8, 12]
    ck.close()


def test_a_run_with_milestones_evaluates_and_keeps_them(tmp_path):
    """The scaling-curve points: evaluated (the held-out metrics at exactly those steps, equal to
    the reference run's where both evaluate) and kept, with periodic evaluation off."""
    from confu_jax.train.loop import parse_milestones

    workdir = str(tmp_path)
    train(_config(**{"train.steps": 9, "train.eval_every": 0, "train.checkpoint.every": 4,
                     "train.checkpoint.keep": 1, "train.milestones": "2,3,6"}), workdir)
    assert [r["step"] for r in read_csv(os.path.join(workdir, "eval.csv"))] == [2, 3, 6, 9]
    ck = Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
    assert ck.all_steps() == [2, 3, 6, 9]  # 4 and 8 pruned by keep=1; 9 is the end of the run
    ck.close()
    with pytest.raises(ValueError, match="comma-separated step numbers"):
        parse_milestones("8;16")
    with pytest.raises(ValueError, match=">= 1"):
        parse_milestones("0,8")
    assert parse_milestones(" 8, 16 ,") == {8, 16}


def test_init_from_copies_shared_params_and_reports_the_rest(tmp_path):
    """EAGLE-3 -> ConFu: same-path same-shape params copied, new / reshaped ones keep init."""
    mesh = shd.make_mesh(2, 2, 2)
    k = jax.random.split(jax.random.PRNGKey(0), 6)
    src_params = {"draft": {"fc": {"kernel": jax.random.normal(k[0], (12, 4))},
                            "norm": {"scale": jax.random.normal(k[1], (4,))},
                            "old_only": {"kernel": jax.random.normal(k[2], (4, 4))}}}
    ck = Checkpointer(str(tmp_path), every=1)
    ck.save(5, {"step": jnp.int32(5), "params": src_params, "rng": jax.random.PRNGKey(1)},
            {"position": 0})
    ck.wait()
    ck.close()
    fresh = {"draft": {"fc": {"kernel": jnp.zeros((12, 4))},
                       "norm": {"scale": jnp.zeros((8,))}},  # reshaped
             "future": {"moe": {"kernel": jnp.ones((4, 2))}}}  # ConFu-only
    fresh = jax.device_put(fresh, shd.tree_shardings(fresh, mesh))
    merged, report = init_params_from(str(tmp_path), fresh)
    assert report.step == 5
    assert report.copied == ["draft/fc/kernel"]
    assert report.kept_init == ["future/moe/kernel"]
    assert report.shape_mismatch == [("draft/norm/scale", (4,), (8,))]
    assert report.ignored == ["draft/old_only/kernel"]
    np.testing.assert_array_equal(merged["draft"]["fc"]["kernel"], src_params["draft"]["fc"]["kernel"])
    assert merged["draft"]["fc"]["kernel"].sharding == fresh["draft"]["fc"]["kernel"].sharding
    np.testing.assert_array_equal(merged["draft"]["norm"]["scale"], np.zeros(8))
    np.testing.assert_array_equal(merged["future"]["moe"]["kernel"], np.ones((4, 2)))


# ----------------------------------------------------------------------------- killed runs

_KILL_RUNNER = r"""
import json, os, signal, sys
sys.path.insert(0, {tests!r})
sys.path.insert(0, {repo!r})
from test_checkpoint_resume import _config
from confu_jax.train.loop import train

kill_at = int(sys.argv[2])

def kill(step, state, metrics):
    if step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)

train(_config(), sys.argv[1], hooks=[kill])
raise SystemExit("not killed")
"""


@pytest.mark.slow
def test_sigkill_mid_training_resumes_with_identical_losses(tmp_path, reference):
    ref_rows, ref_eval = reference
    workdir = str(tmp_path / "run")
    # the resumed run reuses the killed run's executables from the persistent compilation cache
    env = dict(os.environ, PYTHONPATH=REPO, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    # Killed one step after step 6's checkpoint was handed to the async writer: depending on the
    # race, checkpoint 6 is complete or only a temporary directory; both must resume exactly.
    p = subprocess.run([sys.executable, "-c", _KILL_RUNNER.format(tests=os.path.dirname(os.path.abspath(__file__)), repo=REPO),
                        workdir, "7"], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    killed_rows = read_csv(os.path.join(workdir, "metrics.csv"))
    assert killed_rows[-1]["step"] == 7
    ck = Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
    last = ck.latest_step()
    ck.close()
    assert last in (3, 6)  # 6 only if its async write finished before the kill
    overrides = [f"--config.{k}={v}" for k, v in OVERRIDES.items()]
    p = subprocess.run([sys.executable, "-m", "launch.train", "--config", TOY_CONFIG,
                        "--workdir", workdir, *overrides], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads(p.stdout[p.stdout.index("{"):])
    assert summary["start_step"] == last and summary["step"] == 12
    _assert_same_trajectory(read_csv(os.path.join(workdir, "metrics.csv")), ref_rows)
    _assert_same_trajectory(read_csv(os.path.join(workdir, "eval.csv")), ref_eval)


def test_sigterm_checkpoints_at_once_and_stops(tmp_path, reference):
    ref_rows, _ = reference
    workdir = str(tmp_path)
    cfg = _config(**{"train.checkpoint.every": 100, "train.eval_every": 0})

    def preempt(step, state, metrics):
        if step == 4:
            os.kill(os.getpid(), signal.SIGTERM)

    result = train(cfg, workdir, hooks=[preempt])
    assert result.preempted and result.step == 5  # noticed at the next step boundary
    ck = Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
    assert ck.all_steps() == [5]  # the preemption checkpoint (periodic ones are every 100)
    ck.close()
    # what it logged so far is the reference trajectory (resuming is the SIGKILL test's job)
    _assert_same_trajectory(read_csv(os.path.join(workdir, "metrics.csv")), ref_rows[:5])


@pytest.mark.slow
def test_resume_refuses_a_changed_config_and_allows_extending_the_run(tmp_path):
    from confu_jax.train.loop import check_resume_config

    workdir = str(tmp_path / "run")
    train(_config(**{"train.steps": 3}), workdir)
    # what is trained changed: refused before any work, the keys named with both values
    with pytest.raises(ValueError, match=r"toy\.seq_len: 16 -> 24; train\.optim\.lr: 0\.003 -> 0\.01"):
        train(_config(**{"train.steps": 6, "train.optim.lr": 0.01, "toy.seq_len": 24}), workdir)
    # how long it runs, how it logs and checkpoints, the mesh: allowed
    result = train(_config(**{"train.steps": 5, "train.log_every": 2, "train.mesh.fsdp": 1}), workdir)
    assert (result.start_step, result.step) == (3, 5)
    saved = json.load(open(os.path.join(workdir, "config.json")))
    assert saved["train"]["steps"] == 5  # the run's config follows the allowed changes
    # settings added to the code after the run was written are not a change
    check_resume_config(workdir, _config(**{"train.steps": 5, "train.log_every": 2, "train.mesh.fsdp": 1}))
    del saved["toy"]["feature_noise"]
    json.dump(saved, open(os.path.join(workdir, "config.json"), "w"))
    check_resume_config(workdir, _config(**{"train.steps": 5}))


@pytest.mark.slow
def test_init_from_remaps_the_draft_lm_head_by_target_id(tmp_path):
    """A source run whose draft vocabulary differs: each draft id takes the column of its target id
    in the source head (ids the source lacks keep their fresh init), never a column of another token."""
    from configs.tiny import get_config
    from confu_jax.models.params import init_trainable
    from confu_jax.models.spec import model_spec_from_config
    from confu_jax.runs.heads import load_trained_head

    src = str(tmp_path / "e3")
    c = get_config("eagle3")
    c.train.steps, c.train.eval_every, c.train.progress_bar, c.train.tensorboard = 1, 0, False, "off"
    c.train.checkpoint.async_save = False
    train(c, src)
    head = load_trained_head(src)
    src_d2t, src_kernel = head.draft_vocab["d2t"], head.trainable["draft"]["lm_head"]["kernel"]
    spec = model_spec_from_config(get_config("confu"))
    fresh = init_trainable(spec, jax.random.PRNGKey(9))
    v_draft = spec.head.draft_vocab_size
    # the new run's vocabulary: the source's ids in reverse order, one replaced by an id it lacks
    new_d2t = np.array(src_d2t[::-1])
    missing = int(np.setdiff1d(np.arange(spec.target.vocab_size), src_d2t)[0])
    new_d2t[0] = missing
    params, report = init_params_from(os.path.join(src, "checkpoints"), fresh, draft_vocab_d2t=new_d2t)
    kernel = np.asarray(params["draft"]["lm_head"]["kernel"])
    assert report.lm_head_remap == {"matched": v_draft - 1, "fresh": 1}
    np.testing.assert_array_equal(kernel[:, 0], np.asarray(fresh["draft"]["lm_head"]["kernel"])[:, 0])
    for i in range(1, v_draft):
        j = int(np.nonzero(src_d2t == new_d2t[i])[0][0])
        np.testing.assert_array_equal(kernel[:, i], src_kernel[:, j])
    np.testing.assert_array_equal(np.asarray(params["draft"]["fc"]["kernel"]), head.trainable["draft"]["fc"]["kernel"])
    # the same vocabulary: a plain copy
    same, report = init_params_from(os.path.join(src, "checkpoints"), fresh, draft_vocab_d2t=np.asarray(src_d2t))
    assert report.lm_head_remap is None
    np.testing.assert_array_equal(np.asarray(same["draft"]["lm_head"]["kernel"]), src_kernel)


_LOCK_HOLDER = """
import sys, time
from confu_jax.runs.lock import workdir_lock
with workdir_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_second_run_on_a_live_workdir_is_refused_and_a_killed_holder_leaves_no_lock(tmp_path):
    """Two trainers on one workdir would race on its checkpoints and metrics: the second is refused
    before it writes anything, naming the first one's pid; once that process is gone (even by
    SIGKILL, which runs no clean-up) the workdir trains again."""
    from confu_jax.runs.lock import WorkdirLocked

    workdir = str(tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", _LOCK_HOLDER, workdir], env=dict(os.environ, PYTHONPATH=REPO),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(WorkdirLocked, match=rf"pid {holder.pid}\b"):
            train(_config(**{"train.steps": 2}), workdir)
        assert not os.path.exists(os.path.join(workdir, "config.json"))
        assert not os.path.exists(os.path.join(workdir, "checkpoints"))
    finally:
        holder.kill()
        holder.wait()
    result = train(_config(**{"train.steps": 2}), workdir)
    assert (result.start_step, result.step) == (0, 2)
