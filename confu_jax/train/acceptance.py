"""Training-time estimates of the acceptance length τ, from per-TTT-step hits.

τ (tokens per target pass, bonus included) is what decoding speed depends on; measuring it needs
the decode loop, which is too slow to run at every evaluation. TTT already drafts L_ttt steps at
every position with the draft's own hidden states, so the chain a greedy decode would accept can
be read off its hits (docs/DESIGN.md §4 "Training objective", §9 τ).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp


def chain_acceptance_length(correct_rbt: jax.Array, valid_rbt: jax.Array) -> jax.Array:
    """Mean accepted length τ of a greedy chain of S drafted tokens, from per-TTT-step hits.

    At a position, drafting step s is accepted iff steps 0..s are all correct (top-1 equal to
    the target's token) and valid; τ = 1 (the bonus token) + number of accepted draft tokens,
    averaged over positions where step 0 is valid — the Spec-Bench τ for chain drafting. TTT
    feeds the draft its own hidden states, so this is the training-time estimate of the τ
    the decode loop would measure on the same data with a chain of length S.
    """
    ok_rbt = jnp.logical_and(correct_rbt, valid_rbt).astype(jnp.int32)
    run_rbt = jnp.cumprod(ok_rbt, axis=0)  # 1 while all previous steps are accepted
    accepted_bt = jnp.sum(run_rbt, axis=0).astype(jnp.float32)
    base_bt = valid_rbt[0].astype(jnp.float32)
    return 1.0 + jnp.sum(accepted_bt * base_bt) / jnp.maximum(jnp.sum(base_bt), 1.0)


def simulated_acceptance_length(correct_rbn: jax.Array, answer_rbn: jax.Array, in_draft_rbn: jax.Array,
                                 base_bn: Optional[jax.Array] = None) -> jax.Array:
    """Expected tokens per verification (bonus included) of a greedy chain of depth L_ttt.

    Estimator: a draft index j is a verification starting point if ``base_bn`` (the loss passes
    x[j+1] and x[j+2] both answer tokens — the bonus and the first drafted token — and, for ConFu,
    j inside an anchor window) and its first drafted token x[j+2] is an answer token. Step s is accepted
    iff steps 0..s all had draft top-1 == target top-1, the target's token has a draft id (else the
    draft cannot propose it) and x[j+2+s] is still inside the answer. τ = 1 + mean over starting
    points of the number of accepted steps (``chain_acceptance_length``).
    TTT conditions step s on the true tokens x[..j+1+s]; under greedy decoding those equal the
    accepted draft tokens exactly when x is the target's own greedy output (self-distilled data),
    so the hits are exact for such data. Their mean over *every* starting point is not the loop's τ,
    though: decoding starts passes only where the previous one ended
    (``decode_path_acceptance_length``), and the mean exceeds it where acceptance varies.
    """
    start = answer_rbn
    if base_bn is not None:
        start = start & base_bn[None]
    return chain_acceptance_length(correct_rbn & in_draft_rbn, start)


def decode_path_acceptance_length(correct_rbn: jax.Array, answer_rbn: jax.Array, in_draft_rbn: jax.Array,
                                  start_bn: jax.Array, answer_bn: jax.Array, depth: int) -> jax.Array:
    """Tokens per verification pass along the path a greedy chain decode of ``depth`` drafts takes
    through each row — the τ the decode loop reports, where ``simulated_acceptance_length`` is a
    mean over every starting point.

    Why a second estimator: decoding starts a pass only where the previous one ended, so it visits
    few points inside easy stretches (one pass covers several of their tokens) and every point of
    the hard ones. With acceptance that varies along the text (boilerplate, code, free prose) the
    per-position mean exceeds tokens per pass: half the text at 4 tokens per pass and half at 1
    gives a mean of 2.5 but 1.6 tokens per pass.

    The walk (docs/DESIGN.md §3): a pass at anchor j (root x[j+1] already emitted) accepts a_j
    drafts x[j+2..j+1+a_j] (leading steps r < ``depth`` whose draft top-1 was the target's, with a
    draft id, on answer tokens) and emits them plus the bonus x[j+2+a_j] if the answer goes on;
    the next anchor is j+1+a_j. Each row's walk starts at its first starting point (the anchor
    after prefill: j = first answer index − 1) and skips indices that are not starting points
    (``start_bn``: x[j+1], x[j+2] answer tokens, ConFu: anchored), so a row holding several answers
    restarts at each. ``correct_rbn``/``answer_rbn``/``in_draft_rbn`` [R,B,N] as in
    ``simulated_acceptance_length`` (step r at index j predicts x[j+2+r]); ``answer_bn`` [B,N] the
    loss mask (is the bonus x[j+2+a_j] there to emit). Exact for greedy chain decoding of the target's
    own greedy text at ``depth`` <= R (the loop regenerates that text); for ConFu the lag of each
    pass's contemplate is evaluation's draw, not the previous pass's accepted length.
    """
    b, n = start_bn.shape
    idx_n = jnp.arange(n)
    ok_rbn = correct_rbn[:depth] & in_draft_rbn[:depth] & answer_rbn[:depth]  # read at starting points only
    run_bn = jnp.sum(jnp.cumprod(ok_rbn.astype(jnp.int32), axis=0), axis=0)
    bonus_pos = idx_n[None] + 2 + run_bn
    bonus_bn = jnp.take_along_axis(answer_bn, jnp.minimum(bonus_pos, n - 1), axis=1) & (bonus_pos < n)
    emitted_bn = run_bn + bonus_bn.astype(jnp.int32)

    def step(carry, j):
        next_b, tokens_b, passes_b = carry
        here_b = start_bn[:, j] & (j >= next_b)
        return (jnp.where(here_b, j + 1 + run_bn[:, j], next_b), tokens_b + jnp.where(here_b, emitted_bn[:, j], 0),
                passes_b + here_b.astype(jnp.int32)), None

    zeros = jnp.zeros((b,), jnp.int32)
    (_, tokens_b, passes_b), _ = jax.lax.scan(step, (zeros, zeros, zeros), idx_n)
    return jnp.sum(tokens_b).astype(jnp.float32) / jnp.maximum(jnp.sum(passes_b), 1).astype(jnp.float32)


def conditional_step_accuracy(correct_rbn: jax.Array, answer_rbn: jax.Array, in_draft_rbn: jax.Array,
                              base_bn: Optional[jax.Array] = None) -> jax.Array:
    """[R] float32: P(step r right | steps 0..r−1 right at the same index j), per TTT step r
    (speculators' ``prev_correct``: a running AND of the steps' correctness per draft start).

    Over the starting points of ``simulated_acceptance_length`` (``base_bn`` ∧ x[j+2] an answer
    token); "right" is the same hit that estimator counts: the draft's top-1 equals the target's
    argmax, which has a draft id, and x[j+2+r] is an answer token. Step r's count is the starting
    points whose steps 0..r are all right; its denominator those whose steps 0..r−1 are (every
    starting point for r = 0). So an answer's end counts as a miss (as in the chain, where it stops
    the run), and the chain's τ is recovered exactly: τ_sim = 1 + Σ_r Π_{s ≤ r} cond_acc[s]. A step
    no index reached (denominator 0) reads 0, like ``acc/step{r}``; the product is then 0 from the
    step before it on, so the identity still holds.

    Why: the unconditional ``acc/step{r}`` mixes two things — how often a deep step is right, and
    whether it is right where the shallower ones were. Only the second is accepted; a head that
    repeats its previous guess (``step_duplication_rate``) can have a fair unconditional accuracy
    at step 2 and a conditional one near 0.
    """
    start_bn = answer_rbn[0] if base_bn is None else answer_rbn[0] & base_bn
    ok_rbn = correct_rbn & in_draft_rbn & answer_rbn & start_bn[None]
    run_rbn = jnp.cumprod(ok_rbn.astype(jnp.int32), axis=0)  # 1 while steps 0..r are all right
    num_r = jnp.sum(run_rbn, axis=(1, 2)).astype(jnp.float32)
    den_r = jnp.concatenate([jnp.sum(start_bn.astype(jnp.int32))[None], jnp.sum(run_rbn[:-1], axis=(1, 2))])
    return num_r / jnp.maximum(den_r.astype(jnp.float32), 1.0)


def step_duplication_rate(top1_rbn: jax.Array, valid_rbn: jax.Array) -> jax.Array:
    """[R−1] float32: for r = 1..R−1, the fraction of valid (r, j) whose step-r top-1 equals step
    r−1's top-1 at the same index j (0 where step r has no valid index).

    With the draft's top-1 it is the duplication rate — a draft that predicts the token it has just
    predicted again (undertrained deep steps copy the previous step's guess); with the teacher's
    argmax on the same (r, j) it is how often the text itself repeats a token, the rate to compare
    it with. ``valid_rbn``: the (r, j) that ``acc/step{r}`` averages over.
    """
    same_rbn = (top1_rbn[1:] == top1_rbn[:-1]) & valid_rbn[1:]
    cnt_r = jnp.sum(valid_rbn[1:], axis=(1, 2)).astype(jnp.float32)
    return jnp.sum(same_rbn, axis=(1, 2)).astype(jnp.float32) / jnp.maximum(cnt_r, 1.0)


def masked_head_terms(metrics: dict, name: str, nll_bn: jax.Array, top1_bn: jax.Array, labels_bn: jax.Array,
                      valid_bn: jax.Array):
    """One head's (Medusa head, MLP speculator stage, MTP depth) mean CE over the ``valid`` positions,
    with ``ce/{name}``, ``acc/{name}`` (top-1 equal to the label) and ``count/{name}`` written to
    ``metrics`` -> (ce, hit_bn: right and valid)."""
    w = valid_bn.astype(jnp.float32)
    count = w.sum()
    ce = jnp.sum(nll_bn * w) / jnp.maximum(count, 1.0)
    hit = (top1_bn == labels_bn) & valid_bn
    metrics[f"ce/{name}"] = ce
    metrics[f"acc/{name}"] = jnp.sum(hit) / jnp.maximum(count, 1.0)
    metrics[f"count/{name}"] = count
    return ce, hit


def heads_acceptance_length(hits_kbn: jax.Array, answer_bn: jax.Array) -> jax.Array:
    """τ of a greedy chain read off teacher-forced heads: ``hits_kbn[k, b, t]`` = head k (which
    predicts x[t+k+2]) is right at t. From every t whose next token x[t+1] is an answer token,
    1 + the leading run of right heads 0..; exact for a chain when the text is the target's own
    greedy output (the chain's heads read the tokens the earlier heads chose, the true ones while
    they are right)."""
    start = jnp.pad(answer_bn[:, 1:], ((0, 0), (0, 1)))
    run = jnp.sum(jnp.cumprod(hits_kbn.astype(jnp.int32), axis=0), axis=0)  # [B, N]
    ws = start.astype(jnp.float32)
    return 1.0 + jnp.sum(run * ws) / jnp.maximum(ws.sum(), 1.0)
