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
    so τ is exact for such data and an estimate otherwise; answer ends cut chains short, a slight
    under-estimate for long chains.
    """
    start = answer_rbn
    if base_bn is not None:
        start = start & base_bn[None]
    return chain_acceptance_length(correct_rbn & in_draft_rbn, start)
