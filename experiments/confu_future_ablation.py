"""Does a ConFu head use its future entry? Decode with the entry as trained, with its hidden slot
zeroed, or with no entry at all, and compare τ question by question.

    python experiments/confu_future_ablation.py {asis,zero,none} <launch.decode_bench flags>

ConFu's draft attends one extra key/value per iteration, the **future entry**: token slot MoE_f(g[a])
and hidden slot f[a], the target's contemplate output (``decode.drafting.future_entry``; docs/DESIGN.md
§4). ``zero`` replaces f[a] by zeros (the token slot stays), ``none`` drops the entry (the head then
drafts as an EAGLE-3 head with ConFu's weights). Decoding stays lossless in every mode (the draft only
changes what is proposed), so the rows differ in τ alone; a head whose τ does not move when f is
zeroed has not learned to read the future. Pair the rows with ``launch.tau_compare``. The patch
applies before anything is traced; one mode per process.
"""

import sys

import jax.numpy as jnp
from absl import app

from confu_jax.decode import drafting

MODES = ("asis", "zero", "none")


def patch(mode: str) -> None:
    original = drafting.future_entry
    if mode == "zero":
        def zeroed(target, dp, hs, anchor_b, g_bad=None):
            return original(target, dp, hs.replace(future_bd=jnp.zeros_like(hs.future_bd)), anchor_b, g_bad)

        drafting.future_entry = zeroed
    elif mode == "none":
        drafting.future_entry = lambda *args, **kwargs: None
    elif mode != "asis":
        raise SystemExit(f"mode must be one of {MODES}, got {mode!r}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    patch(sys.argv[1])
    from launch import decode_bench

    app.run(decode_bench.main, argv=[sys.argv[0]] + sys.argv[2:])
