"""Budget ``auto``: pick the draft plan (chain length / tree size) that maximises tokens per second
for this model pair on this device.

Estimator. A speculative pass with plan P costs t(P) seconds (draft + target verification of
T(P) nodes + commit) and emits τ(P) tokens on average (accepted drafts + the bonus token), so the
expected throughput is

    tokens/s(P) = E[τ(P)] / t(P).

* t(P) is measured on the device: the compiled speculative loop decodes the calibration prompts
  and the wall time is divided by the passes it made (``measure_plan``). Drafting, the
  verification pass, the accept rule and the cache commit are timed together, as they run — on a
  CPU a T-token verification costs far more than a 1-token step (docs/RESULTS.md "Decode cost
  against the memory floor": T=16 is 2.6x T=1 there), on an accelerator much less, which is
  exactly why the choice is device-specific.
* E[τ(P)] is the τ measured with the head on a few calibration prompts (greedy, EOS off; mean of
  ``accept_log_bi``) in the same runs that give t(P) (``measure_plan``: one compile per plan).
  Without running a plan, chains can also be estimated: from the accepted lengths n (bonus
  excluded) of a chain:K run — with a greedy draft the first k drafts of chain:K are chain:k's, so
  E[τ(chain:k)] = 1 + Σ_{i≤k} P(n ≥ i) (``tau_chain_from_accepts``) — or from per-depth
  conditional rates α_i such as training's simulated acceptance: 1 + Σ_i Π_{j≤i} α_j
  (``tau_from_rates``).
* Plain AR is a candidate too (``AR``: τ = 1 by definition, t = the measured AR step on the same
  prompts): speculation is switched off where it does not pay, as serving engines do. On a 2-core
  CPU with an untrained head that is the right answer, and a benchmark that never considered it
  would report a slow-down as the best the method can do.
* ``choose`` takes the argmax; ties go to the smaller T (less work for the same estimate; AR
  counts as one node).

The calibration prompts should not be the prompts later measured (the benchmark passes its own
held-out set, picked by ``pick_calibration``): a plan chosen on the measured questions would be
fitted to them.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional, Sequence

import numpy as np

from confu_jax.decode.families import family_of
from confu_jax.decode.family import DEFAULT_CHAINS, DEFAULT_TREES

AR = "ar"  # the no-speculation candidate: plain autoregressive decoding


def default_candidates(method: str) -> tuple:
    """Budget auto's default candidate plans for a method's drafter family (chains, then trees)."""
    fam = family_of(method)
    return fam.chains, fam.trees


@dataclasses.dataclass(frozen=True)
class Candidate:
    plan: str  # plan text (decode.families.parse_drafter of ``method``)
    expected_tau: float  # tokens per pass
    pass_s: float  # seconds per pass
    method: str = "eagle3"  # whose drafter the plan configures (budget auto may compare families)

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


def plan_nodes(plan: str, method: str = "eagle3") -> int:
    """Target positions a full pass of ``method``'s ``plan`` verifies (AR: the one token it decodes)."""
    if plan == AR:
        return 1
    from confu_jax.decode.families import parse_drafter

    return parse_drafter(method, plan).n_nodes


def choose(candidates: Sequence[Candidate]) -> Candidate:
    """The candidate with the highest expected tokens/s (ties: fewer tree nodes)."""
    if not candidates:
        raise ValueError("budget auto: no candidate plans")
    return min(candidates, key=lambda c: (-c.tokens_per_s, plan_nodes(c.plan, c.method)))


def _timed_call(run, timed: bool):
    """(result, seconds) of ``run()`` blocked until ready; an untimed call (a warm-up: it compiles)
    reads no clock."""
    import jax

    if not timed:
        return jax.block_until_ready(run()), None
    t0 = time.perf_counter()
    res = jax.block_until_ready(run())
    return res, time.perf_counter() - t0


def _plan_runner(target, drafter_params, plan: str, *, max_new_tokens: int, min_bucket: int, method: str,
                 unroll_layers: Optional[bool] = None, mesh=None):
    """decode(prompt) -> (seconds, passes, accepted lengths incl. bonus) of ``method``'s ``plan``,
    greedy, EOS off, batch 1 (``timed=False``: a warm-up call, nothing returned)."""
    from confu_jax.decode.families import parse_drafter
    from confu_jax.decode.loop import generate_speculative

    p = parse_drafter(method, plan)
    kw = dict(max_new_tokens=max_new_tokens, eos_ids=(), min_bucket=min_bucket, unroll_layers=unroll_layers,
              mesh=mesh)

    def decode(prompt, timed=True):
        res, seconds = _timed_call(lambda: generate_speculative(target, p, drafter_params, [list(prompt)], **kw),
                                       timed)
        if not timed:
            return None
        n = int(np.asarray(res.n_passes_b)[0])
        return seconds, n, np.asarray(res.accept_log_bi)[0, :n].tolist()

    return decode


def _ar_runner(target, *, max_new_tokens: int, min_bucket: int, unroll_layers: Optional[bool] = None,
               mesh=None):
    """decode(prompt) -> (seconds, steps after the first token, [1] * steps) of plain AR decoding
    of the target (greedy, EOS off, batch 1): the first token comes from the prefill."""
    from confu_jax.decode.generate import generate_ar

    kw = dict(max_new_tokens=max_new_tokens, eos_ids=(), min_bucket=min_bucket, unroll_layers=unroll_layers,
              mesh=mesh)

    def decode(prompt, timed=True):
        res, seconds = _timed_call(lambda: generate_ar(target.params, target.config, [list(prompt)], **kw), timed)
        if not timed:
            return None
        steps = max(1, int(np.asarray(res.n_generated_b)[0]) - 1)
        return seconds, steps, [1] * steps

    return decode


def _warm(decode, prompts, min_bucket: int, what: str) -> None:
    """Compile ``decode``'s programs for every prompt bucket (one untimed call per bucket), with a
    progress line while it lasts (``progress.phase``)."""
    from confu_jax import progress
    from confu_jax.decode.requests import one_prompt_per_bucket

    with progress.phase(f"budget auto: compiling {what}"):
        for prompt in one_prompt_per_bucket(prompts, min_bucket):
            decode(prompt, timed=False)


def _summarise(timed, what: str):
    """(mean τ, accepted drafts per pass, seconds per pass) of [(seconds, passes, accept log)]."""
    seconds = sum(t[0] for t in timed)
    passes = sum(t[1] for t in timed)
    if not passes:
        raise ValueError(f"calibration with {what} made no verification pass")
    per_pass = np.asarray([a for t in timed for a in t[2]], np.float64)
    return float(per_pass.mean()), per_pass - 1, seconds / passes


def measure_plan(target, drafter_params, plan: str, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 64,
                 min_bucket: int = 64, method: str = "eagle3"):
    """(mean τ, accepted-draft counts per pass, seconds per pass) of ``method``'s ``plan``, greedy,
    EOS off. A drafter with several pass widths (prompt lookup) averages its narrow and full
    passes: seconds per pass x passes = the wall time, so τ / seconds per pass is its tokens/s.

    One compiled program per plan and prompt bucket: a warm-up call per bucket compiles them all
    (``decode.requests.one_prompt_per_bucket``; warming only the first prompt put the other buckets'
    compilation inside the timed calls and doubled SmolLM2's measured pass cost, docs/RESULTS.md),
    then every prompt is decoded once, batch 1, and timed."""
    decode = _plan_runner(target, drafter_params, plan, max_new_tokens=max_new_tokens, min_bucket=min_bucket,
                          method=method)
    _warm(decode, prompts, min_bucket, f"{method} {plan}")
    return _summarise([decode(p) for p in prompts], plan)


def measure_ar(target, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 64,
               min_bucket: int = 64) -> float:
    """Seconds per token of plain AR decoding of ``target`` (greedy, EOS off, batch 1),
    on the same prompts and bucket as ``measure_plan``: the wall time over the tokens after the
    first (which comes from the prefill)."""
    decode = _ar_runner(target, max_new_tokens=max_new_tokens, min_bucket=min_bucket)
    _warm(decode, prompts, min_bucket, AR)
    return _summarise([decode(p) for p in prompts], "ar")[2]


def pick_calibration(pool: Sequence[Sequence[int]], measured: Sequence[Sequence[int]], n: int, *,
                     min_bucket: int = 64) -> list[int]:
    """Indices of ``n`` held-out prompts (token ids) of ``pool`` for budget auto's calibration, in
    pool order: evenly spread over the pool's prompts that share the padded width
    (``decode.requests.bucket_length``) most of the ``measured`` prompts have (ties: the narrower),
    then, if that width holds fewer than ``n``, evenly spread over the rest.

    Why that width: the loops compile one program per (plan, prompt width), and compiling is most
    of a short benchmark's time on a CPU (the quickstart on a 2-core AVX2 host: ~40 s a SmolLM2
    loop program, 24 programs in a 19-minute run, docs/RESULTS.md "The main job"). Calibration
    prompts of the measured prompts' commonest width compile each candidate once, and the measured
    rows then reuse the candidates they share (chain:3, AR) through the compilation cache, where
    prompts spread over the pool added a width of every candidate. Calibrating at that width
    also measures each plan's pass at the cache size most measured prompts decode with."""
    from collections import Counter

    from confu_jax.decode.requests import bucket_length

    if n <= 0 or not pool:
        return []
    widths = [bucket_length(len(p), min_bucket) for p in pool]
    counts = Counter(bucket_length(len(p), min_bucket) for p in measured)
    target = min(counts, key=lambda w: (-counts[w], w)) if counts else None

    def spread(idx, k):
        return idx[:: max(1, len(idx) // k)][:k] if k > 0 else []

    chosen = spread([i for i, w in enumerate(widths) if w == target], n)
    chosen += spread([i for i, w in enumerate(widths) if w != target], n - len(chosen))
    return sorted(chosen)


def release_compiled() -> None:
    """Drop every compiled XLA program of this process. Each XLA:CPU executable keeps its code in
    mmapped sections; a calibration or benchmark compiling dozens of programs (a candidate x every
    prompt bucket) reached Linux's default 65530 mappings per process, and LLVM then aborted
    ("Unable to allocate section memory") or the compiler crashed (docs/RESULTS.md). Every
    candidate is measured once, so nothing is lost but the programs' memory."""
    import jax

    jax.clear_caches()


def auto_plan(target, drafter_params, prompts: Sequence[Sequence[int]], *, chains: Sequence[str] = DEFAULT_CHAINS,
              trees: Sequence[str] = DEFAULT_TREES, max_new_tokens: int = 64, include_ar: bool = True,
              log: Optional[Callable[[str], None]] = None, method: str = "eagle3", min_bucket: int = 64,
              interleave: bool = False, unroll_layers: Optional[bool] = None, mesh=None):
    """Measure every candidate plan of ``method`` on the calibration prompts and choose -> (best,
    all Candidates). One compile per candidate; E[τ] is the candidate's own measured τ. With
    ``include_ar`` plain AR (``AR``, τ = 1) competes too, so the choice may be to not speculate.
    ``max_new_tokens`` and ``min_bucket`` should be the decoding's own: a step's cost grows with
    the cache it attends (prompt bucket + answer length), AR's and a pass's differently.

    ``interleave``: every candidate decodes prompt 1, then every candidate prompt 2, ... (the first
    rotating), instead of one candidate over all prompts after another: a change of the machine's
    speed during calibration then moves every candidate alike instead of favouring the ones measured
    while it was fast (on the shared 2-core VM, AR calibrated 7% apart in two runs: more than the
    margin auto decides by, docs/RESULTS.md). All candidates' programs stay compiled together.
    ``unroll_layers``: the target's layer schedule, the one the decoding it chooses for runs (None:
    the backend's default). ``mesh``: the device mesh the decoding runs on (``decode.sharded``), so
    each candidate is timed as it will run."""
    kw = dict(max_new_tokens=max_new_tokens, min_bucket=min_bucket, unroll_layers=unroll_layers, mesh=mesh)
    runners = ([(AR, _ar_runner(target, **kw))] if include_ar else []) + [
        (plan, _plan_runner(target, drafter_params, plan, method=method, **kw)) for plan in (*chains, *trees)]
    timed = {plan: [] for plan, _ in runners}
    label = {plan: plan if plan == AR else f"{method} {plan}" for plan, _ in runners}  # progress lines
    if interleave:
        for plan, decode in runners:
            _warm(decode, prompts, min_bucket, label[plan])
        for i, prompt in enumerate(prompts):
            r = i % len(runners)
            for plan, decode in runners[r:] + runners[:r]:
                timed[plan].append(decode(prompt))
    else:
        for plan, decode in runners:
            _warm(decode, prompts, min_bucket, label[plan])
            timed[plan] = [decode(p) for p in prompts]
            if plan != AR:
                release_compiled()  # each candidate's programs are used once (mmap limit)
    cands = []
    for plan, _ in runners:
        tau, _, pass_s = _summarise(timed[plan], plan)
        cands.append(Candidate(plan, tau, pass_s, method))  # AR: τ = 1 (one token a step)
        if log and plan == AR:
            log(f"budget auto: ar: {pass_s * 1e3:.1f} ms/token, {cands[-1].tokens_per_s:.1f} tokens/s")
        elif log:
            log(f"budget auto: {plan}: E[tau]={tau:.3f}, {pass_s * 1e3:.1f} ms/pass, "
                f"{cands[-1].tokens_per_s:.1f} tokens/s expected")
    if interleave:
        release_compiled()
    return choose(cands), cands
