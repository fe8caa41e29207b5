"""Budget ``auto``: pick the draft plan (chain length / tree size) that maximises tokens per second
for this model pair on this device.

Estimator. A speculative pass with plan P costs t(P) seconds (draft + target verification of
T(P) nodes + commit) and emits τ(P) tokens on average (accepted drafts + the bonus token), so the
expected throughput is

    tokens/s(P) = E[τ(P)] / t(P).

* t(P) is measured on the device: the compiled speculative loop is run for a fixed number of
  passes and the wall time divided by the passes it made (``measure_pass_s``). Drafting, the
  verification pass, the accept rule and the cache commit are timed together, as they run — on a
  CPU a T-token verification costs far more than a 1-token step (FACTS.md: T=16 is 2.2x T=1), on
  an accelerator much less, which is exactly why the choice is device-specific.
* E[τ(P)] comes from acceptance measured with the head on a few calibration prompts:
  - chains: from the distribution of accepted lengths n (bonus excluded) of ONE calibration run
    with the longest chain: with a greedy draft the first k draft tokens of chain:K are those of
    chain:k, so E[τ(chain:k)] = 1 + Σ_{i=1..k} P(n ≥ i)  (``tau_chain_from_accepts``);
  - per-depth conditional rates α_i (e.g. training's simulated acceptance): E[τ] =
    1 + Σ_i Π_{j≤i} α_j  (``tau_from_rates``);
  - trees: the τ a calibration run with that tree measured (mean of ``accept_log_bi``).
* ``choose`` takes the argmax; ties go to the smaller T (less work for the same estimate).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional, Sequence

import numpy as np

DEFAULT_CHAINS = tuple(f"chain:{k}" for k in range(1, 8))
# EAGLE-2-style dynamic trees with T-1 = 4, 8, 16, 30, 60 non-root nodes
DEFAULT_TREES = ("dynamic:3,2,4", "dynamic:4,4,8", "dynamic:5,6,16", "dynamic:6,8,30", "dynamic:6,10,60")


@dataclasses.dataclass(frozen=True)
class Candidate:
    plan: str  # loop.parse_plan text
    expected_tau: float  # tokens per pass
    pass_s: float  # seconds per pass

    @property
    def tokens_per_s(self) -> float:
        return self.expected_tau / self.pass_s


def tau_from_rates(rates_d: Sequence[float], depth: int) -> float:
    """E[τ] of a chain of ``depth`` drafts with conditional per-depth acceptance rates."""
    if depth > len(rates_d):
        raise ValueError(f"need acceptance rates for {depth} depths, have {len(rates_d)}")
    r = np.clip(np.asarray(rates_d[:depth], np.float64), 0.0, 1.0)
    return float(1.0 + np.cumprod(r).sum())


def tau_chain_from_accepts(accepted_n: Sequence[int], k: int, k_calibrated: int) -> float:
    """E[τ(chain:k)] from accepted-draft counts (bonus excluded) of a chain:``k_calibrated`` run."""
    if k > k_calibrated:
        raise ValueError(f"chain:{k} cannot be estimated from a chain:{k_calibrated} calibration")
    n = np.asarray(accepted_n, np.int64)
    if n.size == 0:
        raise ValueError("no calibration passes")
    return float(1.0 + sum(np.mean(n >= i) for i in range(1, k + 1)))


def plan_nodes(plan: str) -> int:
    from confu_jax.decode.loop import parse_plan

    return parse_plan(plan).n_nodes_total


def choose(candidates: Sequence[Candidate]) -> Candidate:
    """The candidate with the highest expected tokens/s (ties: fewer tree nodes)."""
    if not candidates:
        raise ValueError("budget auto: no candidate plans")
    return min(candidates, key=lambda c: (-c.tokens_per_s, plan_nodes(c.plan)))


def measure_pass_s(spec, params, plan: str, prompt_ids: Sequence[int], *, n_passes: int = 16,
                   repeats: int = 2, eos_ids=()) -> float:
    """Seconds per speculative pass of ``plan`` (compiled loop, greedy, EOS off, best of repeats)."""
    import jax

    from confu_jax.decode.loop import compile_speculative, parse_plan

    p = parse_plan(plan)
    max_new = n_passes * (p.max_depth + 1) + 1  # enough that the loop makes >= n_passes passes
    run, args = compile_speculative(spec, params, p, [list(prompt_ids)], max_new_tokens=max_new,
                                    eos_ids=eos_ids)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = jax.block_until_ready(run(params, *args))
        dt = time.perf_counter() - t0
        best = min(best, dt / max(int(np.asarray(res.n_passes_b)[0]), 1))
    return best


def calibrate_tau(spec, params, plan: str, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 64,
                  eos_ids=None):
    """(mean τ, accepted-draft counts per pass) of ``plan`` over ``prompts``, greedy."""
    from confu_jax.decode.loop import generate_speculative, parse_plan

    res = generate_speculative(spec, params, parse_plan(plan), [list(p) for p in prompts],
                               max_new_tokens=max_new_tokens, eos_ids=eos_ids)
    log = np.asarray(res.accept_log_bi)
    passes = np.asarray(res.n_passes_b)
    per_pass = np.concatenate([log[b, :passes[b]] for b in range(log.shape[0])])
    if per_pass.size == 0:
        raise ValueError(f"calibration with {plan} made no verification pass")
    return float(per_pass.mean()), per_pass - 1


def auto_plan(spec, params, prompts: Sequence[Sequence[int]], *, chains: Sequence[str] = DEFAULT_CHAINS,
              trees: Sequence[str] = DEFAULT_TREES, max_new_tokens: int = 64,
              log: Optional[Callable[[str], None]] = None):
    """Measure and choose -> (best Candidate, all Candidates). One calibration run for all chains
    (the longest) and one per tree; one timing run per candidate."""
    cands = []
    if chains:
        k_max = max(int(c.split(":")[1]) for c in chains)
        _, accepted = calibrate_tau(spec, params, f"chain:{k_max}", prompts, max_new_tokens=max_new_tokens)
        for c in chains:
            tau = tau_chain_from_accepts(accepted, int(c.split(":")[1]), k_max)
            cands.append(Candidate(c, tau, measure_pass_s(spec, params, c, prompts[0])))
            if log:
                log(f"budget auto: {c}: E[tau]={tau:.3f}, {cands[-1].pass_s * 1e3:.1f} ms/pass")
    for t in trees:
        tau, _ = calibrate_tau(spec, params, t, prompts, max_new_tokens=max_new_tokens)
        cands.append(Candidate(t, tau, measure_pass_s(spec, params, t, prompts[0])))
        if log:
            log(f"budget auto: {t}: E[tau]={tau:.3f}, {cands[-1].pass_s * 1e3:.1f} ms/pass")
    return choose(cands), cands
