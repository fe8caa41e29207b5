"""The training contract, checked for every record of the drafter-family registry that trains
(``confu_jax.catalog``: the entries with a training task): its ``tiny_config`` trains on the random tiny target;
a run killed after step 11 and started again computes the steps after its last checkpoint to exactly the
losses the killed (so far uninterrupted) run logged for them; every export
format the record lists, written by ``launch.export_head``'s writer from the resumed run, loads back through the
record's loader to the run's own drafter weights. A family added to the registry is checked here without
a line of its own (apart from this file, ``tests/contract/test_family_contract.py`` decodes with every record).
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from confu_jax import catalog
from confu_jax.decode import families
from confu_jax.decode.families import METHODS

TRAINED = sorted(e.name for e in catalog.training())


@pytest.mark.slow
@pytest.mark.parametrize("family", TRAINED)
def test_training_resumes_after_a_kill_and_every_export_loads_back(family, tmp_path):
    """The record's tiny config trains 12 steps; a run killed after step 11 and started again recomputes the
    steps after its last checkpoint to the killed run's losses exactly (tests/helpers/train_resume.py); every
    export format of the record, written by ``launch.export_head``'s writer
    from the resumed run, loads back through the record's loader to the run's own drafter weights."""
    from tests.helpers.train_resume import assert_killed_run_resumes, tiny_run_config

    from confu_jax.models.spec import model_spec_from_config
    from confu_jax.train.target_loading import load_target

    rec = families.FAMILIES[family]
    tiny = catalog.entry(family).tiny_config
    workdir, _ = assert_killed_run_resumes(tmp_path, tiny)
    config = tiny_run_config(tiny)
    variant = config.confu.variant
    method = next(n for n, m in METHODS.items() if m.family == family and (not m.variants or m.variants[0] == variant))
    spec, tp = load_target(config, model_spec_from_config(config))
    run = families.decode_head(method, spec.target, tp, workdir)
    assert run.trained and "step 12" in run.source, run.source
    want = run.drafter_params
    for f in rec.export_formats:
        # the writer ``launch.export_head --format`` calls, on the target the run trained against (what the
        # command loads from the run's config); the command line itself: tests/contract/test_eagle3_formats.py,
        # tests/e2e/test_own_target.py
        fmt, out = f.name, str(tmp_path / f"export_{f.name}")
        os.makedirs(out)
        summary = f.write(workdir, out, target=(spec.target, tp) if f.reads_target else None,
                          target_source=str(config.model.source) if f.reads_target else "")
        assert "step 12" in summary, summary  # the resumed run's last checkpoint
        back = families.decode_head(method, spec.target, tp, out).drafter_params
        assert jax.tree_util.tree_structure(back.weights) == jax.tree_util.tree_structure(want.weights), fmt
        jax.tree_util.tree_map(np.testing.assert_array_equal, back.weights, want.weights)
        jax.tree_util.tree_map(np.testing.assert_array_equal, back.draft_vocab, want.draft_vocab)
