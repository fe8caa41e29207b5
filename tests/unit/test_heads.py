"""``train.heads.load_trained_head``: a launch.train workdir comes back bit-exact (params at the
last step, the run's draft vocabulary), and broken workdirs fail with errors that name them."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from configs.tiny import get_config
from confu_jax.decode.drafting import HeadDrafter
from confu_jax.runs.heads import load_trained_head
from confu_jax.train.loop import train


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("run") / "eagle3")
    config = get_config("eagle3")
    config.train.steps = 2
    config.train.eval_every = 0
    config.train.checkpoint.every = 1
    config.train.checkpoint.async_save = False
    config.train.progress_bar = False
    config.train.tensorboard = "off"
    seen = {}

    def hook(step, state, metrics):
        seen[step] = jax.tree_util.tree_map(np.asarray, jax.device_get(state.params))

    train(config, workdir, hooks=[hook])
    return workdir, seen


def test_latest_and_named_step_restore_exactly(trained):
    workdir, seen = trained
    head = load_trained_head(workdir)
    assert head.step == 2 and head.spec.head.variant == "eagle3"
    assert head.config.model.preset == "tiny"
    flat_got = jax.tree_util.tree_leaves_with_path(head.trainable)
    flat_want = jax.tree_util.tree_leaves_with_path(seen[2])
    assert [p for p, _ in flat_got] == [p for p, _ in flat_want]
    for (p, g), (_, w) in zip(flat_got, flat_want):
        np.testing.assert_array_equal(g, w, err_msg=jax.tree_util.keystr(p))
    # step 1 differs from step 2 (one AdamW update) and restores as seen at step 1
    h1 = load_trained_head(workdir, step=1)
    np.testing.assert_array_equal(h1.trainable["draft"]["fc"]["kernel"], seen[1]["draft"]["fc"]["kernel"])
    assert not np.array_equal(h1.trainable["draft"]["fc"]["kernel"], seen[2]["draft"]["fc"]["kernel"])
    # the draft vocabulary: d2t a distinct set of target ids, t2d its indicator
    d2t, t2d = head.draft_vocab["d2t"], head.draft_vocab["t2d"]
    assert d2t.shape == (head.spec.head.draft_vocab_size,) and len(np.unique(d2t)) == len(d2t)
    assert np.array_equal(np.flatnonzero(t2d), np.sort(d2t))


def test_errors_name_the_problem(trained, tmp_path):
    workdir, _ = trained
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_trained_head(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="has no checkpoint for step 7.*\\[1, 2\\]"):
        load_trained_head(workdir, step=7)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(os.path.join(workdir, "config.json"), bare / "config.json")
    with pytest.raises(FileNotFoundError, match="saved no checkpoint"):
        load_trained_head(str(bare))
    (bare / "checkpoints").mkdir()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_trained_head(str(bare))
    # a config for a different head than the checkpoint holds
    other = tmp_path / "other"
    shutil.copytree(workdir, other)
    with open(other / "config.json") as f:
        cfg = json.load(f)
    cfg["confu"]["variant"] = "confu"
    with open(other / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(Exception, match="params|confu"):
        load_trained_head(str(other))


@pytest.mark.slow
def test_trained_head_decodes_losslessly_and_checks_the_method(trained):
    """The loaded head plugs into the speculative loop: greedy output == AR on the run's target."""
    from confu_jax.decode.generate import generate_ar
    from confu_jax.decode.families import decode_head
    from confu_jax.decode.loop import generate_speculative
    from confu_jax.decode.plans import parse_plan
    from confu_jax.train.target_loading import load_target

    workdir, _ = trained
    head = load_trained_head(workdir)
    spec, target = load_target(head.config, head.spec)
    dh = decode_head("eagle3", spec.target, target, workdir)
    assert dh.trained and dh.source.endswith("(step 2)")
    prompts = [[3, 5, 7, 2, 9], [4, 4, 1]]
    ar = generate_ar(target, spec.target, prompts, max_new_tokens=12, eos_ids=())
    sp = generate_speculative(dh.target, HeadDrafter(parse_plan("chain:2")), dh.drafter_params, prompts,
                              max_new_tokens=12, eos_ids=())
    for b in range(2):
        n = int(np.asarray(sp.n_generated_b)[b])
        assert n == 12
        assert np.asarray(sp.tokens_bn)[b, :n].tolist() == np.asarray(ar.tokens_bn)[b, :n].tolist()
    with pytest.raises(ValueError, match="holds a 'eagle3' head"):
        decode_head("confu", spec.target, target, workdir)
    with pytest.raises(ValueError, match="vocab_size"):
        decode_head("eagle3", spec.target.replace(vocab_size=64), target, workdir)


def test_head_is_refused_on_a_different_target_of_the_same_shape(trained, tmp_path):
    """A base and an instruct model of one architecture must not load each other's heads: the
    workdir's target.json fingerprint is checked against the loaded target's weights."""
    from confu_jax.decode.families import decode_head
    from confu_jax.runs.heads import read_target_record, target_fingerprint
    from confu_jax.train.target_loading import load_target

    workdir, _ = trained
    head = load_trained_head(workdir)
    spec, target = load_target(head.config, head.spec)
    record = read_target_record(workdir)
    assert record is not None and record["fingerprint"] == target_fingerprint(target)
    # the fingerprint ignores the dtype the same weights are loaded in, but not the weights
    as_bf16 = jax.tree_util.tree_map(lambda x: np.asarray(jax.numpy.asarray(x, jax.numpy.bfloat16)), target)
    assert target_fingerprint(as_bf16) == target_fingerprint(target)
    tuned = jax.tree_util.tree_map(np.array, target)
    tuned["final_norm"]["scale"] = tuned["final_norm"]["scale"] * 1.5  # same shapes, other weights
    with pytest.raises(ValueError, match="trained against a different target"):
        decode_head("eagle3", spec.target, tuned, workdir)
    # a workdir from before fingerprints: accepted (architecture checked) with a warning
    old = tmp_path / "old"
    shutil.copytree(workdir, old)
    os.remove(old / "target.json")
    assert decode_head("eagle3", spec.target, tuned, str(old)).trained


def test_random_head_with_a_smaller_draft_vocabulary():
    """Cost measurements use random heads shaped like trained ones: V_draft rows in the draft LM
    head, draft id i = target id i."""
    from confu_jax.decode.drafting import random_head
    from confu_jax.models.presets import get_preset
    from confu_jax.models.spec import HeadConfig, ModelSpec
    from tests.helpers.model_fakes import tiny_params

    cfg = get_preset("tiny")
    tp, _ = tiny_params(ModelSpec(cfg, HeadConfig(variant="eagle3", draft_vocab_size=cfg.vocab_size)))
    head = random_head("confu", cfg, tp, draft_vocab_size=16)
    assert head.spec.head.draft_vocab_size == 16 and not head.trained
    assert np.array_equal(np.asarray(head.drafter_params.draft_vocab["d2t"]), np.arange(16))
    t2d = np.asarray(head.drafter_params.draft_vocab["t2d"])
    assert t2d.shape == (cfg.vocab_size,) and t2d[:16].all() and not t2d[16:].any()
    assert {x.shape[-1] for x in jax.tree_util.tree_leaves(head.drafter_params.weights["lm_head"])} == {16}
    with pytest.raises(ValueError, match="draft_vocab_size must be in"):
        random_head("eagle3", cfg, tp, draft_vocab_size=cfg.vocab_size + 1)


def test_a_head_source_can_name_one_checkpoint_step(trained):
    """``WORKDIR@STEP`` (decode_bench --heads, launch.scaling_curve) decodes that step's head."""
    from confu_jax.decode.families import decode_head
    from confu_jax.decode.loaded import split_step
    from confu_jax.models.spec import model_spec_from_config
    from confu_jax.train.target_loading import load_target

    workdir, seen = trained
    assert split_step("runs/e3@64") == ("runs/e3", 64)
    assert split_step("runs/e3") == ("runs/e3", None)
    assert split_step("runs/a@b/e3") == ("runs/a@b/e3", None)  # not digits after the last '@'
    assert split_step(None) == (None, None)
    config = load_trained_head(workdir).config
    spec, target_params = load_target(config, model_spec_from_config(config))
    for source, step in ((f"{workdir}@1", 1), (f"{workdir}@2", 2), (workdir, 2)):
        head = decode_head("eagle3", spec.target, target_params, source)
        assert head.source.endswith(f"(step {step})")
        np.testing.assert_array_equal(np.asarray(head.drafter_params.weights["fc"]["kernel"]),
                                      seen[step]["draft"]["fc"]["kernel"])
    with pytest.raises(FileNotFoundError, match="step 9"):
        decode_head("eagle3", spec.target, target_params, f"{workdir}@9")
    with pytest.raises(ValueError, match="EAGLE-3 / ConFu heads only"):
        decode_head("medusa", spec.target, target_params, f"{workdir}@1")
