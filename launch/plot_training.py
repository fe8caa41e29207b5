"""Training curves of several ``launch.train`` runs on one figure, on a shared step axis.

    python -m launch.plot_training --runs eagle3=runs/e3,confu=runs/confu@200 --out curves.png

``NAME=WORKDIR[@OFFSET]``: a run started from another's checkpoint (``checkpoint.init_from``) is
shifted by ``OFFSET`` steps so that equal budgets line up (ConFu started from EAGLE-3 at step 200
is drawn from x = 200). Reads ``metrics.csv`` (train) and ``eval.csv`` (held-out) from each
workdir; plots the loss, the simulated acceptance length τ_sim and the step-0 top-1 accuracy, and
prints a table of the last logged values per run (``--every`` thins it), with the held-out τ along
a greedy chain decode's path (``decode_tau/chain<--chain>``), the figure to compare with decoding.
"""

from __future__ import annotations

import csv
import os

from absl import app, flags

flags.DEFINE_list("runs", [], "NAME=WORKDIR[@OFFSET],... (launch.train workdirs)")
flags.DEFINE_string("out", "training_curves.png", "figure path (.png)")
flags.DEFINE_integer("smooth", 5, "moving average over this many logged points (train curves only)")
flags.DEFINE_integer("every", 50, "table: one row per this many (shifted) steps, plus the last")
flags.DEFINE_integer("chain", 3, "table: the held-out decode-path τ of a greedy chain of this depth "
                     "(eval decode_tau/chain<N>; '–' for runs that do not log it)")
FLAGS = flags.FLAGS

PANELS = (("loss", "loss (0.8^s-weighted TTT KL)"), ("acceptance_length", "τ_sim (train batch)"),
          ("acc/step0", "top-1 accuracy, draft step 0"))


def parse_run(text: str) -> tuple[str, str, int]:
    if "=" not in text:
        raise ValueError(f"--runs: expected NAME=WORKDIR[@OFFSET], got {text!r}")
    name, rest = text.split("=", 1)
    path, offset = (rest.rsplit("@", 1) + ["0"])[:2] if "@" in rest else (rest, "0")
    if not offset.isdigit():
        raise ValueError(f"--runs: offset of {name!r} must be a step count, got {offset!r}")
    return name, path, int(offset)


def read_csv(path: str) -> list[dict]:
    """Rows of a metrics CSV as floats; a resumed run may log a step twice (the later one wins)."""
    if not os.path.isfile(path):
        return []
    by_step = {}
    with open(path, newline="") as f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            try:
                by_step[int(float(row["step"]))] = {k: float(v) for k, v in row.items() if v not in ("", None)}
            except (KeyError, ValueError) as e:
                raise ValueError(f"{path}:{line}: expected a numeric 'step' and metric values ({e})") from e
    return [by_step[s] for s in sorted(by_step)]


def smooth(values: list[float], n: int) -> list[float]:
    out = []
    for i in range(len(values)):
        window = values[max(0, i - n + 1): i + 1]
        out.append(sum(window) / len(window))
    return out


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected positional arguments {argv[1:]}")
    if not FLAGS.runs:
        raise app.UsageError("--runs is required")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        runs = [parse_run(r) for r in FLAGS.runs]
    except ValueError as e:
        raise app.UsageError(str(e))
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4))
    path_key = f"decode_tau/chain{FLAGS.chain}"
    print(f"| run | step | loss | τ_sim | acc step 0 | held-out loss | held-out τ_sim | held-out τ chain:{FLAGS.chain} |")
    print("|---|---|---|---|---|---|---|---|")
    for name, path, offset in runs:
        try:
            train_rows = read_csv(os.path.join(path, "metrics.csv"))
            eval_rows = {int(r["step"]): r for r in read_csv(os.path.join(path, "eval.csv"))}
        except ValueError as e:
            raise app.UsageError(str(e))
        if not train_rows:
            raise app.UsageError(f"{path}: no metrics.csv rows (is it a launch.train workdir?)")
        steps = [int(r["step"]) + offset for r in train_rows]
        for ax, (key, label) in zip(axes, PANELS):
            ys = [r.get(key, float("nan")) for r in train_rows]
            (line,) = ax.plot(steps, smooth(ys, FLAGS.smooth), label=name)
            ev = [(s + offset, r[key]) for s, r in sorted(eval_rows.items()) if key in r]
            if ev:
                ax.plot(*zip(*ev), "o--", color=line.get_color(), label=f"{name} (held-out)")
            ax.set_xlabel("optimizer step (shared axis)")
            ax.set_title(label)
        last = train_rows[-1]["step"]
        for r in train_rows:
            s = int(r["step"])
            if s % FLAGS.every == 0 or s == last:
                e = eval_rows.get(s, {})
                fmt = lambda d, k: f"{d[k]:.3f}" if k in d else "–"  # noqa: E731
                print(f"| {name} | {s + offset} | {fmt(r, 'loss')} | {fmt(r, 'acceptance_length')} | "
                      f"{fmt(r, 'acc/step0')} | {fmt(e, 'loss')} | {fmt(e, 'acceptance_length')} | {fmt(e, path_key)} |")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
    fig.savefig(FLAGS.out, dpi=110)
    print(f"figure: {FLAGS.out}")
    return 0


if __name__ == "__main__":
    app.run(main)
