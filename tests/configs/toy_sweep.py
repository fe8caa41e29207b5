"""A 2x2 sweep of the toy task (tests/e2e/test_sweep.py): learning rate x the head's hidden width."""


def get_sweep():
    return dict(
        config="toy_train.py",
        overrides={"train.steps": 30, "train.eval_every": 10, "train.checkpoint.every": 1},
        product={"train.optim.lr": [1e-3, 3e-3], "toy.head_dim": [32, 64]},
        metric="acceptance_length",
    )
