"""EAGLE-3 on SmolLM2: learning rate x anchors per row, 400 steps each (the CPU recipe of docs/RESULTS.md).

    python -m launch.sweep --spec sweeps/smollm2_eagle3_lr_ktrain.py --sweep_dir runs/sweep_lr_k

Format: confu_jax/runs/sweep.py. Each point is one launch.train run; the table ranks the points by
the held-out simulated acceptance length τ_sim (``acceptance_length``).
"""


def get_sweep():
    return dict(
        config="../configs/smollm2_eagle3.py",
        overrides={"train.steps": 400, "train.eval_every": 100, "data.max_length": 256,
                   "data.global_batch_size": 4},
        product={"train.optim.lr": [3e-4, 1e-3], "objective.k_train": [32, 64]},
        metric="acceptance_length",
    )
