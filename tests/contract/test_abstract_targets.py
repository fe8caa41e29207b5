"""Every training family builds its task against an abstract target (``model.source='abstract'``: the
preset's shapes, no weights, no data): what ``launch.train --compile_only --topology`` and
``experiments/compile_8b.py`` compile for "does it fit?". Families that initialise from the target's
weights (Medusa's LM heads, MTP's layer) initialise from zeros of their shapes inside the traced init;
nothing here allocates the target. (Found by the 8B grid: Medusa, the MLP speculator, MTP, DFlash and
DSpark read their tokenizer from the model source and stopped with "model 'abstract' is neither a known
asset".) The compile itself, per family, is the compile lane's (tests/compile)."""

import runpy

import jax
import pytest

from confu_jax import catalog
from confu_jax.train.tasks import load_task

CONFIGS = sorted({c for e in catalog.training() for c in e.configs if "smollm2_" in c})
ROWS, BATCH = 256, 4


@pytest.mark.parametrize("path", CONFIGS)
def test_every_family_builds_its_task_on_an_abstract_target(path):
    config = runpy.run_path(path)["get_config"]()
    with config.unlocked():
        config.model.source = "abstract"
        config.model.preset = "smollm2-135m"
        config.data.max_length, config.data.global_batch_size = ROWS, BATCH
        config.data.pack = False
        config.train.mesh.data, config.train.mesh.fsdp, config.train.mesh.tensor = 1, 1, 1
        if "target_features" in config.data:
            config.data.target_features = ""
    task = load_task(config)
    leaves = jax.tree_util.tree_leaves(task.frozen_abstract)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    n_target = sum(x.size for x in leaves)
    assert 130e6 < n_target < 140e6, n_target  # SmolLM2-135M's shapes, nothing read
    params = jax.eval_shape(task.init_params, jax.random.PRNGKey(0))
    assert jax.tree_util.tree_leaves(params["draft"]), path
    batch = next(task.train_iterator(0, 1))
    assert batch["tokens"].shape == (BATCH, ROWS) and batch["loss_mask"].all()
    assert task.target_fingerprint is None  # no weights: no fingerprint
