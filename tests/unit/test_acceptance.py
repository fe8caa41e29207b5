"""Training-time τ estimates against the decode loop and against a plain-Python walk.

``decode_tau/chain{D}`` (``train.acceptance.decode_path_acceptance_length``) claims to be the τ a
greedy chain:D decode measures on the target's own greedy text; the end-to-end test holds it to
that on a tiny model: decode, then score the decoded sequence with the training loss.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.decode.drafting import HeadDrafter
from confu_jax.decode import loop, plans
from confu_jax.train import loss as L
from confu_jax.train.acceptance import decode_path_acceptance_length, simulated_acceptance_length
from tests.helpers.loop_fixtures import make


def _walk_reference(correct, answer, in_draft, start, mask, depth):
    """The decode path of docs/DESIGN.md §3, one row and one index at a time."""
    r_steps, b, n = correct.shape
    tokens = passes = 0
    for row in range(b):
        nxt = 0
        for j in range(n):
            if not start[row, j] or j < nxt:
                continue
            run = 0
            while run < depth and correct[run, row, j] and answer[run, row, j] and in_draft[run, row, j]:
                run += 1
            bonus = j + 2 + run < n and mask[row, j + 2 + run]
            tokens += run + int(bonus)
            passes += 1
            nxt = j + 1 + run
    return tokens / max(passes, 1)


@pytest.mark.parametrize("seed", range(6))
def test_decode_path_matches_a_python_walk(seed):
    rng = np.random.default_rng(seed)
    r_steps, b, n = 4, 3, 40
    mask = np.zeros((b, n), bool)
    for row in range(b):  # one or two answers per row (a packed row restarts its walk)
        mask[row, 5:18] = True
        if row != 1:
            mask[row, 24:37] = True
    answer = np.stack([np.pad(mask[:, 2 + r:], ((0, 0), (0, 2 + r)))[:, :n] for r in range(r_steps)])
    start = np.pad(mask[:, 1:], ((0, 0), (0, 1))) & np.pad(mask[:, 2:], ((0, 0), (0, 2)))
    correct = rng.random((r_steps, b, n)) < 0.7
    in_draft = rng.random((r_steps, b, n)) < 0.95
    for depth in (1, 2, 4):
        got = float(decode_path_acceptance_length(jnp.asarray(correct), jnp.asarray(answer), jnp.asarray(in_draft),
                                                  jnp.asarray(start), jnp.asarray(mask), depth))
        assert got == pytest.approx(_walk_reference(correct, answer, in_draft, start, mask, depth), abs=1e-6)


def test_per_position_mean_overstates_tokens_per_pass_when_acceptance_varies():
    # half the answer always accepted (4 tokens a pass at depth 3), half never (1 a pass)
    n, r_steps = 200, 3
    mask = np.zeros((1, n), bool)
    mask[0, 4:196] = True
    answer = np.stack([np.pad(mask[:, 2 + r:], ((0, 0), (0, 2 + r)))[:, :n] for r in range(r_steps)])
    start = np.pad(mask[:, 1:], ((0, 0), (0, 1))) & np.pad(mask[:, 2:], ((0, 0), (0, 2)))
    correct = np.zeros((r_steps, 1, n), bool)
    correct[:, :, :100] = True
    ones = np.ones_like(correct)
    args = [jnp.asarray(x) for x in (correct, answer, ones)]
    mean = float(simulated_acceptance_length(*args, jnp.asarray(start)))
    path = float(decode_path_acceptance_length(*args, jnp.asarray(start), jnp.asarray(mask), r_steps))
    assert mean > 2.4 and path < 1.7  # ~2.5 vs ~1.6 (module docstring)


@pytest.mark.slow
@pytest.mark.parametrize("vocab,seed", [(4, 0), (4, 4), (6, 2)])
def test_decode_tau_metric_equals_the_loops_tau_on_its_own_greedy_text(vocab, seed):
    # EAGLE-3 on the target's greedy continuation: the loop regenerates exactly that text, so the
    # training metric computed on it must equal tokens per pass of the loop, for every chain depth.
    spec, tp, params = make("eagle3", vocab, seed=seed)
    prompt = [t % vocab for t in [2, 0, 3, 1, 1, 2, 0, 3]]
    trainable = {"draft": params.drafter_params.weights, "confu": params.drafter_params.verify_params}
    n_new, r_steps = 40, 3
    for depth in (1, 2, 3):
        res = loop.generate_speculative(params.target, HeadDrafter(plans.parse_plan(f"chain:{depth}")),
                                        params.drafter_params, [prompt],
                                        max_new_tokens=n_new, eos_ids=())
        out = np.asarray(res.tokens_bn)[0, : int(res.n_generated_b[0])].tolist()
        passes = int(res.n_passes_b[0])
        log = np.asarray(res.accept_log_bi)[0, :passes]
        loop_tau = log.sum() / passes
        if depth == 3:
            assert len(set(log.tolist())) > 1  # some passes accept drafts and some do not

        seq = prompt + out
        batch = {"tokens": jnp.asarray([seq], jnp.int32),
                 "loss_mask": jnp.asarray([[i >= len(prompt) for i in range(len(seq))]]),
                 "attention_mask": jnp.ones((1, len(seq)), bool)}
        cfg = L.ObjectiveConfig(ttt_steps=r_steps, k_train=L.ALL_POSITIONS, replication=0, max_lag=1)
        _, metrics = L.confu_loss(spec, trainable, tp, params.drafter_params.draft_vocab, batch,
                                  jax.random.PRNGKey(0), cfg)
        assert float(metrics[f"decode_tau/chain{depth}"]) == pytest.approx(loop_tau, abs=1e-6)
