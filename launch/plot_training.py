"""Training curves of several ``launch.train`` runs on one figure, on a shared step axis.

    python -m launch.plot_training --runs eagle3=runs/e3,confu=runs/confu@200 --out curves.png

``NAME=WORKDIR[@OFFSET]``: a run started from another's checkpoint (``checkpoint.init_from``) is
shifted by ``OFFSET`` steps so that equal budgets line up (ConFu started from EAGLE-3 at step 200 is
drawn from x = 200). Workdirs and ``--out`` may be ``gs://`` URLs. Reads ``metrics.csv`` (train) and
``eval.csv`` (held-out) from each workdir; plots the loss, the simulated acceptance length τ_sim and
the step-0 top-1 accuracy, and prints a table of the last logged values per run (``--every`` thins
it), with the held-out τ along a greedy chain decode's path (``decode_tau/chain<--chain>``), the
figure to compare with decoding.

The held-out per-step diagnostics (docs/DESIGN.md §4, items 10-11) get two more panels and a
second table: ``cond_acc/step<r>`` (step r right given steps < r right at the same index) and
``dup_rate/step<r>`` (step r's top-1 repeats step r−1's) beside ``dup_rate_teacher/step<r>`` (the
text's own repeat rate). A deep step whose conditional accuracy is near 0 while its duplication
rate is far above the text's is undertrained; one that tracks the text's rate is not.
"""

from __future__ import annotations

import csv
import os

from absl import app, flags

from confu_jax import storage

flags.DEFINE_list("runs", [], "NAME=WORKDIR[@OFFSET],... (launch.train workdirs)")
flags.DEFINE_string("out", "training_curves.png", "figure path (.png)")
flags.DEFINE_integer("smooth", 5, "moving average over this many logged points (train curves only)")
flags.DEFINE_integer("every", 50, "table: one row per this many (shifted) steps, plus the last")
flags.DEFINE_integer("chain", 3, "table: the held-out decode-path τ of a greedy chain of this depth "
                     "(eval decode_tau/chain<N>; '–' for runs that do not log it)")
FLAGS = flags.FLAGS

PANELS = (("loss", "loss (0.8^s-weighted TTT KL)"), ("acceptance_length", "τ_sim (train batch)"),
          ("acc/step0", "top-1 accuracy, draft step 0"))
STEP_PANELS = (("cond_acc", "held-out: step r right | steps < r right"),
               ("dup_rate", "held-out: step r top-1 = step r−1's (dotted: teacher)"))
STEP_STYLES = ("-", "--", "-.", ":", (0, (5, 1)), (0, (1, 1)), (0, (3, 1, 1, 1)))


def step_values(row: dict, prefix: str) -> dict:
    """{r: value} of the ``<prefix>/step<r>`` metrics of one CSV row."""
    out = {}
    for k, v in row.items():
        head, _, tail = k.rpartition("/step")
        if head == prefix and tail.isdigit():
            out[int(tail)] = v
    return dict(sorted(out.items()))


def step_cell(row: dict, prefix: str) -> str:
    """``<prefix>/step<r>`` of one row as 'r=a: x / y / z' ('–' when the row has none)."""
    vals = step_values(row, prefix)
    if not vals:
        return "–"
    return f"r={min(vals)}: " + " / ".join(f"{v:.3f}" for v in vals.values())


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
    if not storage.isfile(path):
        return []
    by_step = {}
    with storage.open(path, newline="") as f:
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
    fig, grid = plt.subplots(2, len(PANELS), figsize=(5 * len(PANELS), 8))
    axes, step_axes = grid[0], grid[1]
    for ax in step_axes[len(STEP_PANELS):]:
        fig.delaxes(ax)
    diagnostics = []  # held-out per-step rows of the second table
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
        color = axes[0].get_lines()[-1].get_color()
        for ax, (prefix, label) in zip(step_axes, STEP_PANELS):
            series = {}
            for s, r in sorted(eval_rows.items()):
                for step, v in step_values(r, prefix).items():
                    series.setdefault((prefix, step), []).append((s + offset, v))
                if prefix == "dup_rate":
                    for step, v in step_values(r, "dup_rate_teacher").items():
                        series.setdefault(("dup_rate_teacher", step), []).append((s + offset, v))
            for (key, step), pts in series.items():
                ax.plot(*zip(*pts), color=color, marker="o" if key != "dup_rate_teacher" else None,
                        linestyle=":" if key == "dup_rate_teacher" else STEP_STYLES[step % len(STEP_STYLES)],
                        alpha=0.5 if key == "dup_rate_teacher" else 1.0,
                        label=f"{name} r={step}" if key != "dup_rate_teacher" else None)
            ax.set_xlabel("optimizer step (shared axis)")
            ax.set_title(label)
            ax.set_ylim(-0.02, 1.02)
        if eval_rows:
            last_eval = max(eval_rows)
            for s, e in sorted(eval_rows.items()):
                if (s % FLAGS.every == 0 or s == last_eval) and step_values(e, "cond_acc"):
                    diagnostics.append(f"| {name} | {s + offset} | {step_cell(e, 'cond_acc')} | "
                                       f"{step_cell(e, 'dup_rate')} | {step_cell(e, 'dup_rate_teacher')} |")
        last = train_rows[-1]["step"]
        for r in train_rows:
            s = int(r["step"])
            if s % FLAGS.every == 0 or s == last:
                e = eval_rows.get(s, {})
                fmt = lambda d, k: f"{d[k]:.3f}" if k in d else "–"  # noqa: E731
                print(f"| {name} | {s + offset} | {fmt(r, 'loss')} | {fmt(r, 'acceptance_length')} | "
                      f"{fmt(r, 'acc/step0')} | {fmt(e, 'loss')} | {fmt(e, 'acceptance_length')} | {fmt(e, path_key)} |")
    axes[0].legend(fontsize=8)
    if any(ax.get_legend_handles_labels()[0] for ax in step_axes[:len(STEP_PANELS)]):
        step_axes[0].legend(fontsize=7, ncol=2)
    if diagnostics:
        print("\nheld-out per TTT step r (docs/DESIGN.md §4 items 10-11): conditional accuracy, "
              "duplication rate of the draft's top-1 and of the teacher's argmax (the text's own)")
        print("| run | step | cond acc by step | dup rate by step | teacher dup by step |")
        print("|---|---|---|---|---|")
        print("\n".join(diagnostics))
    fig.tight_layout()
    storage.write_figure(FLAGS.out, fig, dpi=110)
    print(f"figure: {FLAGS.out}")
    return 0


if __name__ == "__main__":
    from confu_jax.user_errors import run

    run("launch.plot_training", main)
