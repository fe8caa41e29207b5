"""The ConFu / EAGLE-3 training objective (docs/DESIGN.md §4 "Training objective"; paper §3.3, eq. 3).

One function, :func:`confu_loss`, serves every variant; EAGLE-3 is the same code with the future
path off (no anchors, no contemplate pass, every answer position counts).

Index conventions: docs/DESIGN.md §3 (draft index j, TTT step r, anchor, lag δ, window l).

Pipeline of one call:

1. **Teacher** (no gradient; ``train.teacher``). One real-token target pass gives final-normed hidden states, the
   EAGLE-3 taps h_cat and per-layer K/V. The teacher is the target distribution renormalised over
   the draft vocabulary (EAGLE-3: ``softmax(target_logits[..., d2t])``), computed from the LM-head
   rows in d2t order, so only [B, N, V_draft] logits ever exist. A position is usable only if the
   target's argmax over the *full* vocabulary is in the draft vocabulary (EAGLE-3's ``t2d`` mask);
   that argmax (and the full log-sum-exp, for the diagnostic "teacher mass inside the draft
   vocabulary") is found by a scan over vocabulary chunks of ``vocab_chunk`` columns. Memory:
   B·N·(V_draft + vocab_chunk)·4 bytes instead of B·N·V·4 (Llama-3, N=2048: 0.33 GB instead of
   1.05 GB per row).
2. **Anchors** (ConFu). K_train anchors per row, uniformly without replacement among positions t
   where x[t+1] and x[t+2] are both answer tokens: x[t+1] is the bonus token and x[t+2] the first
   drafted one, which is exactly the situation the draft meets at inference (it never drafts from a
   prompt position other than the last, nor after the final end-of-turn token). Rows with fewer
   candidates get fewer valid anchors (the rest are masked). Each anchor t draws a lag
   δ ~ U{1..max_lag} and its contemplate query reads [con] = MoE_con(h_cat[max(t-δ, 0)]): at
   inference the contemplate after an accepted node at depth k reads h_cat of the previous
   iteration's last accepted token, a lag of k+1 ≤ D+1 (``max_lag`` = D+1).
3. **Replication window**. Draft indices t..t+l use anchor t's future entry ([f]_t, f[t]).
   Overlapping windows: an index takes the *latest* valid anchor whose window covers it — the
   freshest future prediction, as at inference where f always comes from the newest anchor.
   ConFu trains only on indices inside some window (eq. 3 sums over anchor windows only).
4. **TTT** (``draft_ttt``, L_ttt steps). Step r at index j is trained with KL(P_target ‖ P_draft)
   where x[j+2+r] is an answer token inside the sequence and the target argmax at j+1+r is in the
   draft vocabulary. Loss = Σ_r decay^r · (mean over valid (b, j) of the KL): the mean runs over
   every trained (conversation, index) of the batch however conversations are laid into rows, so
   packed rows (several conversations per row, attention block-diagonal, positions restarting per
   conversation, masks never crossing a boundary) give the loss and gradient of the same
   conversations padded one per row (tests/unit/test_packing.py). The head + KL of each
   step is rematerialised in the backward pass, so the [B, N, V_draft] draft logits of the L_ttt
   steps are never all alive together. ConFu evaluates the draft's LM head only at the (at most
   K·(l+1) per row) indices inside windows, gathered to a static [B, M] set: the head is the
   largest cost of the step, and indices outside every window carry no loss.

Metrics (scalars; the training loop's convention ``loss/step{s}``, ``acc/step{s}``): per-step KL
and top-1 agreement with the target, the number of trained positions, teacher diagnostics, and
``acceptance_length`` — see ``train.acceptance.simulated_acceptance_length``; ``decode_tau/chain{D}``
— τ along the path a greedy chain:D decode takes (``train.acceptance.decode_path_acceptance_length``);
``cond_acc/step{r}`` — step r right given steps < r right at the same index, over τ_sim's starting
points (``train.acceptance.conditional_step_accuracy``); ``dup_rate/step{r}`` (r ≥ 1) — the share of
step r's trained indices whose draft top-1 repeats step r−1's, beside ``dup_rate_teacher/step{r}``,
the same share for the teacher's argmax (how often the text itself repeats a token;
``train.acceptance.step_duplication_rate``).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from confu_jax.models.draft import draft_logits
from confu_jax.models.draft_ttt import TTTFuture, draft_ttt
from confu_jax.models.spec import ModelSpec
from confu_jax.models.kv_cache import to_cache_layout
from confu_jax.models.target import contemplate_queries, future_readout
from confu_jax.train.acceptance import (conditional_step_accuracy, decode_path_acceptance_length,
                                        simulated_acceptance_length, step_duplication_rate)
from confu_jax.train.rows import (pin_rows, batch_arrays, row_layout, same_segment_ahead, sample_anchors,
                                  shift_ahead)
from confu_jax.train.teacher import full_vocab_argmax_lse, lm_head_layout, taps_and_teacher


ALL_POSITIONS = 1 << 30  # k_train meaning "every candidate position" (clipped to N)


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    """Static hyper-parameters of the objective (hashable: a jit static argument)."""

    ttt_steps: int = 7  # L_ttt
    k_train: int = 256  # anchors per row (ConFu); clipped to the sequence length
    replication: int = 3  # window l: indices t..t+l share anchor t's future prediction
    max_lag: int = 7  # δ ~ U{1..max_lag}; D+1 for decode tree depth D
    # P(δ = 1..max_lag) up to a constant; () = uniform. At inference the lag is the accepted
    # length of the previous iteration (docs/DESIGN.md §3), so a measured acceptance histogram
    # is the natural choice.
    lag_weights: tuple = ()
    ttt_decay: float = 0.8  # weight of TTT step s is decay**s (EAGLE-3)
    vocab_chunk: int = 8192  # columns per chunk of the full-vocabulary argmax scan (<= 0: one chunk)
    remat: bool = True  # recompute each step's draft logits in the backward pass
    # positions per chunk of the draft head + KL (live logits [B, chunk, V_draft]; <= 0: all at once)
    token_chunk: int = 1024
    # recompute each TTT step's draft MLP in the backward pass (models.draft_ttt remat_mlp)
    remat_mlp: bool = True
    # ConFu, not the paper's (0 = the paper): weight of an auxiliary loss that trains the contemplate's
    # f to name the tokens ahead through the target's frozen LM head (:func:`future_aux_loss`)
    future_aux_weight: float = 0.0
    future_aux_ahead: int = 1  # m: f at anchor t predicts x[t+2 .. t+1+m]
    # > 0: the weight falls linearly to 0 over this many optimizer steps (the step comes in the
    # batch as 'step', added by the train step); 0: constant
    future_aux_anneal_steps: int = 0
    # what each TTT step's draft distribution q is trained toward the teacher's p with (:data:`STEP_LOSSES`);
    # evaluation always reports 'kl', so runs trained with different losses compare on one held-out figure
    step_loss: str = "kl"
    # evaluation only (ConFu): also report what the future entry is worth — the same draft without
    # it (``no_future/...``) and what the contemplate's f predicts by itself (``future/f_top1_x{s}``);
    # one more TTT pass and a full-vocabulary argmax per anchor (:func:`future_probe_metrics`)
    future_probe: bool = False

    def __post_init__(self):
        if self.ttt_steps < 1:
            raise ValueError(f"ObjectiveConfig.ttt_steps must be >= 1, got {self.ttt_steps}")
        if self.step_loss not in STEP_LOSSES:
            raise ValueError(f"objective.step_loss: expected one of {tuple(STEP_LOSSES)}, got {self.step_loss!r}")
        if self.k_train < 1:
            raise ValueError(f"ObjectiveConfig.k_train must be >= 1, got {self.k_train}")
        if self.replication < 0:
            raise ValueError(f"ObjectiveConfig.replication must be >= 0, got {self.replication}")
        if self.max_lag < 1:
            raise ValueError(f"ObjectiveConfig.max_lag must be >= 1, got {self.max_lag}")
        if self.lag_weights and (len(self.lag_weights) != self.max_lag or min(self.lag_weights) < 0
                                 or sum(self.lag_weights) <= 0):
            raise ValueError(f"ObjectiveConfig.lag_weights must be {self.max_lag} (max_lag) non-negative "
                             f"weights with a positive sum, or empty for uniform; got {self.lag_weights}")
        if self.future_aux_weight < 0 or self.future_aux_ahead < 1 or self.future_aux_anneal_steps < 0:
            raise ValueError("ObjectiveConfig: future_aux_weight must be >= 0, future_aux_ahead >= 1 and "
                             f"future_aux_anneal_steps >= 0; got {self.future_aux_weight}, "
                             f"{self.future_aux_ahead}, {self.future_aux_anneal_steps}")


def _lag_weights(config, evaluation: bool) -> tuple:
    """Training's lag weights, or in evaluation ``confu.eval_lag_weights`` when set: runs trained with
    different lag distributions are compared on held-out τ under one (e.g. the measured) distribution."""
    weights = config.confu.get("lag_weights", None) or ()
    if evaluation and config.confu.get("eval_lag_weights", None):
        weights = config.confu.eval_lag_weights
    return tuple(float(w) for w in weights)


def objective_from_config(config, *, evaluation: bool = False) -> ObjectiveConfig:
    """From ``config.draft`` / ``config.confu`` / ``config.objective``.

    ``evaluation``: ``objective.eval_k`` anchors (0: every candidate position) and window 0, so
    each draft index has the future prediction made at that very index — what inference gives it.
    """
    o = config.objective
    k = int(o.eval_k) if evaluation else int(o.k_train)
    return ObjectiveConfig(
        ttt_steps=int(config.draft.ttt_steps),
        k_train=k if k > 0 else ALL_POSITIONS,
        replication=0 if evaluation else int(config.confu.replication),
        max_lag=int(config.confu.max_lag),
        lag_weights=_lag_weights(config, evaluation),
        ttt_decay=float(config.draft.ttt_decay),
        vocab_chunk=int(o.vocab_chunk),
        remat=bool(o.remat),
        token_chunk=int(o.get("token_chunk", 1024)),
        remat_mlp=bool(o.get("remat_mlp", True)),
        # evaluation reports f's cross-entropy (future_probe) but keeps the paper's loss: comparable across runs
        future_aux_weight=0.0 if evaluation else float(o.get("future_aux_weight", 0.0)),
        future_aux_ahead=int(o.get("future_aux_ahead", 1)),
        future_aux_anneal_steps=int(o.get("future_aux_anneal_steps", 0)),
        future_probe=evaluation,
        step_loss="kl" if evaluation else str(o.get("step_loss", "kl")),
    )


# ----------------------------------------------------------------------------- anchors and windows


class AnchorPlan(NamedTuple):
    anchor_bk: jax.Array  # [B,K] int32 anchor positions t, ascending among valid ones (0 if invalid)
    valid_bk: jax.Array  # [B,K] bool
    con_src_bk: jax.Array  # [B,K] int32 max(t - δ, 0): the h_cat that MoE_con reads
    index_bn: jax.Array  # [B,N] int32 anchor whose future entry draft index j uses (-1: none)


def anchor_candidates(loss_mask_bn: jax.Array, segment_ids_bn=None) -> jax.Array:
    """[B,N] bool: t may be an anchor iff x[t+1] and x[t+2] are answer tokens (see module doc) of
    t's own conversation (packed rows: ``segment_ids_bn``)."""
    m = loss_mask_bn.astype(bool)
    cand = shift_ahead(m, 1, False) & shift_ahead(m, 2, False)
    if segment_ids_bn is not None:
        cand = cand & same_segment_ahead(segment_ids_bn, 2)
    return cand


def window_index(anchor_bk: jax.Array, valid_bk: jax.Array, n: int, replication: int,
                 segment_ids_bn=None) -> jax.Array:
    """[B,N] int32: for index j the slot k of the latest valid anchor t with t <= j <= t + l, or -1.
    Packed rows: only anchors of j's own segment (a window never crosses a document boundary)."""
    j = jnp.arange(n, dtype=jnp.int32)[None, None, :]
    a = anchor_bk[:, :, None]
    covers = valid_bk[:, :, None] & (a <= j) & (j <= a + replication)  # [B,K,N]
    if segment_ids_bn is not None:
        seg_a = jnp.take_along_axis(segment_ids_bn, anchor_bk, axis=1)
        covers = covers & (seg_a[:, :, None] == segment_ids_bn[:, None, :])
    score = jnp.where(covers, a, -1)
    best = jnp.argmax(score, axis=1).astype(jnp.int32)  # the latest covering anchor (anchors distinct)
    return jnp.where(jnp.any(covers, axis=1), best, -1)


def sample_lags(rng: jax.Array, shape: tuple, cfg: ObjectiveConfig) -> jax.Array:
    """Contemplate lags δ in 1..max_lag: uniform, or drawn with ``cfg.lag_weights``."""
    if not cfg.lag_weights:
        return jax.random.randint(rng, shape, 1, cfg.max_lag + 1, dtype=jnp.int32)
    logits = jnp.log(jnp.asarray(cfg.lag_weights, jnp.float32))
    return jax.random.categorical(rng, logits, shape=shape).astype(jnp.int32) + 1


def plan_anchors(rng: jax.Array, loss_mask_bn: jax.Array, cfg: ObjectiveConfig, rows=None) -> AnchorPlan:
    """Anchors, lags and windows of a batch. Packed rows (``rows``: a :class:`RowLayout` with segment
    ids): candidates, windows and the lag's source h_cat[max(t - δ, segment start)] stay inside t's
    conversation. K_train counts anchors per *row*, so a packed row spreads its K over its segments."""
    a_rng, l_rng = jax.random.split(rng)
    b, n = loss_mask_bn.shape
    seg = None if rows is None else rows.segment_ids_bn
    anchor_bk, valid_bk = sample_anchors(a_rng, anchor_candidates(loss_mask_bn, seg), cfg.k_train)
    lag_bk = sample_lags(l_rng, anchor_bk.shape, cfg)
    floor_bk = 0 if seg is None else jnp.take_along_axis(rows.segment_start_bn, anchor_bk, axis=1)
    con_src_bk = jnp.maximum(anchor_bk - lag_bk, floor_bk)
    return AnchorPlan(anchor_bk, valid_bk, con_src_bk, window_index(anchor_bk, valid_bk, n, cfg.replication, seg))


# ----------------------------------------------------------------------------- TTT targets


class TTTMasks(NamedTuple):
    answer_rbn: jax.Array  # [R,B,N] bool: x[j+2+s] exists and is an answer token
    in_draft_rbn: jax.Array  # [R,B,N] bool: the target argmax at the teacher row j+1+s has a draft id
    valid_rbn: jax.Array  # [R,B,N] bool: both — (s, j) is trained


def ttt_masks(loss_mask_bn: jax.Array, in_draft_bn: jax.Array, n_steps: int, segment_ids_bn=None) -> TTTMasks:
    """Which (TTT step s, draft index j) are trained; the teacher of (s, j) is teacher row j+1+s.
    Packed rows: x[j+2+s] must also lie in j's segment (never train across a document boundary)."""
    b, n = loss_mask_bn.shape
    pad = jnp.zeros((b, n_steps + 2), bool)
    lm = jnp.concatenate([loss_mask_bn.astype(bool), pad], axis=1)
    ind = jnp.concatenate([in_draft_bn.astype(bool), pad], axis=1)
    answer = jnp.stack([lm[:, 2 + s:2 + s + n] for s in range(n_steps)])
    if segment_ids_bn is not None:
        answer = answer & jnp.stack([same_segment_ahead(segment_ids_bn, 2 + s) for s in range(n_steps)])
    in_draft = jnp.stack([ind[:, 1 + s:1 + s + n] for s in range(n_steps)])
    return TTTMasks(answer, in_draft, answer & in_draft)


# ----------------------------------------------------------------------------- the objective


def _kl(logp, logq):
    return jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)


def _log_acceptance(logp, logq):
    """log Σ min(p, q): the log probability that speculative sampling accepts a token drafted from q when
    the target samples from p (Leviathan et al., 2023), in log space (no 0 · inf where q or p is 0)."""
    return jax.nn.logsumexp(jnp.minimum(logp, logq), axis=-1)


def _tv(logp, logq):
    """Total variation ½Σ|p − q| = 1 − Σ min(p, q): one minus the acceptance probability."""
    return 1.0 - jnp.exp(_log_acceptance(logp, logq))


def _nla(logp, logq):
    """−log max(α, 1e-5), α the acceptance probability: TV's gradient scaled by 1/α, so a draft that
    starts far from the teacher (α near 0, where TV's gradient vanishes) still learns (speculators' nla)."""
    return -jnp.maximum(_log_acceptance(logp, logq), jnp.log(1e-5))


LK_ETA = 3.0  # η of the LK hybrid: speculators' lk_hybrid default, "the paper's best setting"


def _lk(logp, logq):
    """The LK hybrid (Samarin et al., arXiv 2602.23881, as speculators 0.9's ``lk_hybrid``): per position
    λ = exp(−η · sg(α)), loss λ · KL(p ‖ q) + (1 − λ)(1 − α). KL leads while the draft accepts little, the
    acceptance term once it does (KL and acceptance share an optimum; a small draft stops short of it)."""
    log_alpha = _log_acceptance(logp, logq)
    lam = jnp.exp(-LK_ETA * jax.lax.stop_gradient(jnp.exp(log_alpha)))
    return lam * _kl(logp, logq) + (1.0 - lam) * (1.0 - jnp.exp(log_alpha))


def _jsd(logp, logq):
    logm = jnp.logaddexp(logp, logq) - jnp.log(2.0)
    return 0.5 * (_kl(logp, logm) + _kl(logq, logm))


def _hard_ce(logp, logq):
    """Cross-entropy of the draft on the teacher's argmax: distillation from the target's greedy token
    instead of its distribution."""
    return -jnp.take_along_axis(logq, jnp.argmax(logp, axis=-1)[..., None], axis=-1)[..., 0]


# objective.step_loss -> f(teacher log-probs, draft log-probs) [..., V_draft] -> [...]; both over the draft
# vocabulary (the teacher renormalised over it)
STEP_LOSSES = {
    "kl": _kl,  # forward KL(p ‖ q): EAGLE-3's, SpecForge's and speculators' default
    "rkl": lambda logp, logq: _kl(logq, logp),  # reverse KL(q ‖ p)
    "jsd": _jsd,  # Jensen-Shannon
    "tv": _tv,  # 1 − per-token acceptance probability
    "nla": _nla,  # −log acceptance probability (floored at 1e-5)
    "lk": _lk,  # LK hybrid: KL weighted down as acceptance rises, 1 − acceptance weighted up
    "ce": _hard_ce,  # hard distillation: the teacher's argmax as the label
}


def _step_loss(spec: ModelSpec, draft_params: dict, hidden_bnd: jax.Array, teacher_logp_bnv: jax.Array,
             step_loss: str = "kl"):
    """(the step loss [B,N] — KL(p_teacher ‖ p_draft) by default, :data:`STEP_LOSSES` — and the draft
    argmax [B,N]) for one TTT step."""
    logq = jax.nn.log_softmax(draft_logits(spec, draft_params, hidden_bnd), axis=-1)
    return STEP_LOSSES[step_loss](teacher_logp_bnv, logq), jnp.argmax(logq, axis=-1)


def _trained_positions(plan, base_bn: jax.Array, n: int, cfg: ObjectiveConfig):
    """Draft indices whose LM head is evaluated -> (sel_bm [B,M] or None for all N, ok_bm, base_bn).

    ConFu trains only inside anchor windows (eq. 3): at most K·(l+1) indices per row, so only
    those draft positions pay for the [d, V_draft] head, its softmax and its backward.
    """
    b = base_bn.shape[0]
    if plan is None:
        return None, jnp.ones((b, n), bool), base_bn
    in_window_bn = plan.index_bn >= 0
    m = min(n, cfg.k_train * (cfg.replication + 1))
    if m < n:
        sel_bm = jax.vmap(lambda w: jnp.nonzero(w, size=m, fill_value=0)[0])(in_window_bn).astype(jnp.int32)
        ok_bm = jnp.arange(m)[None] < jnp.sum(in_window_bn, axis=1, keepdims=True)
        return sel_bm, ok_bm, base_bn & in_window_bn
    return None, in_window_bn, base_bn & in_window_bn


def _pick(sel_bm, x_bn):
    """[B,N,...] -> [B,M,...] at the trained positions (identity when ``sel_bm`` is None)."""
    return x_bn if sel_bm is None else jnp.take_along_axis(
        x_bn, sel_bm.reshape(sel_bm.shape + (1,) * (x_bn.ndim - 2)), axis=1)


def _head_kl_scan(spec: ModelSpec, draft_params: dict, hidden_rbmd: jax.Array, t_pad: jax.Array, sel_bm, n: int,
                  cfg: ObjectiveConfig):
    """(KL [R,B,M], draft argmax [R,B,M]) of every TTT step's draft head against its teacher rows, as
    one scan over (step, chunk of ``token_chunk`` positions).

    One scan instead of a Python loop over steps: the draft head's weight is gathered once per
    iteration and its gradient accumulates in the scan's carry, where unrolled steps left one full
    float32 [d, V_draft] gradient (and one gathered copy) per step alive until their sum — 14 of
    them on Llama-3.1-8B's 32000-token draft vocabulary. Chunks of positions bound the live logits to
    [B, chunk, V_draft] instead of [B, M, V_draft]; with ``remat`` each iteration is recomputed in the
    backward pass, so nothing of size V_draft is kept per chunk."""
    r_steps, b, m, _ = hidden_rbmd.shape
    c = m if cfg.token_chunk <= 0 else min(int(cfg.token_chunk), m)
    n_c = -(-m // c)
    pad = n_c * c - m
    base_bm = jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32), (b, m)) if sel_bm is None else sel_bm
    base_bm = jnp.pad(base_bm, ((0, 0), (0, pad)))
    # teacher row of (step r, position j): j + 1 + r of the padded teacher
    idx_rcbk = (base_bm.reshape(b, n_c, c).transpose(1, 0, 2)[None] + 1
                + jnp.arange(r_steps, dtype=jnp.int32)[:, None, None, None])
    h = jnp.pad(hidden_rbmd, ((0, 0), (0, 0), (0, pad), (0, 0)))
    h_rcbkd = h.reshape(r_steps, b, n_c, c, -1).transpose(0, 2, 1, 3, 4)

    def one(dp, h_bkd, idx_bk):
        t_bkv = jnp.take_along_axis(t_pad, idx_bk[..., None], axis=1)
        return _step_loss(spec, dp, pin_rows(h_bkd), t_bkv, cfg.step_loss)

    if cfg.remat:  # keeps h per chunk, not [B, chunk, V_draft] logits
        one = jax.checkpoint(one)

    def body(_, x):
        return None, one(draft_params, x[0], x[1])

    flat = (h_rcbkd.reshape((r_steps * n_c,) + h_rcbkd.shape[2:]), idx_rcbk.reshape((r_steps * n_c, b, c)))
    _, (kl, arg) = jax.lax.scan(body, None, flat)

    def unflat(x):  # [R*n_c, B, c] -> [R, B, M]
        return x.reshape(r_steps, n_c, b, c).transpose(0, 2, 1, 3).reshape(r_steps, b, n_c * c)[:, :, :m]

    return unflat(kl), unflat(arg)


def _ttt_losses(spec: ModelSpec, draft_params: dict, ttt, teacher, masks, sel_bm, ok_bm, n: int,
                cfg: ObjectiveConfig):
    """Per-TTT-step KL and accuracy -> (weighted loss, metrics, [R,B,M] hits, answer, in-draft masks)."""
    b = ok_bm.shape[0]
    r_steps = cfg.ttt_steps
    # teacher rows j+1+r for step r: pad N past the end once, index per step
    v_d = teacher.logp_bnv.shape[-1]
    t_pad = pin_rows(jnp.concatenate([teacher.logp_bnv, jnp.zeros((b, r_steps + 1, v_d), jnp.float32)], axis=1))
    t_arg = jnp.argmax(t_pad, axis=-1)
    hidden_rbmd = jnp.stack([pin_rows(_pick(sel_bm, ttt.hidden_rbnd[r])) for r in range(r_steps)])
    kl_rbm, arg_rbm = _head_kl_scan(spec, draft_params, hidden_rbmd, t_pad, sel_bm, n, cfg)
    metrics, loss = {}, jnp.zeros((), jnp.float32)
    correct, answer, in_draft, draft_top1, teacher_top1, trained = [], [], [], [], [], []
    for r in range(r_steps):
        kl_bm, arg_bm = kl_rbm[r], arg_rbm[r]
        trained_bm = _pick(sel_bm, masks.valid_rbn[r]) & ok_bm
        w_bm = trained_bm.astype(jnp.float32)
        cnt = jnp.maximum(jnp.sum(w_bm), 1.0)
        kl_r = jnp.sum(kl_bm * w_bm) / cnt
        t_arg_bm = t_arg[:, 1 + r:1 + r + n] if sel_bm is None else jnp.take_along_axis(t_arg, sel_bm + 1 + r, axis=1)
        hit_bm = arg_bm == t_arg_bm
        correct.append(hit_bm)
        draft_top1.append(arg_bm)
        teacher_top1.append(t_arg_bm)
        trained.append(trained_bm)
        answer.append(_pick(sel_bm, masks.answer_rbn[r]))
        in_draft.append(_pick(sel_bm, masks.in_draft_rbn[r]))
        loss = loss + (cfg.ttt_decay ** r) * kl_r
        metrics[f"loss/step{r}"] = kl_r
        metrics[f"acc/step{r}"] = jnp.sum(hit_bm * w_bm) / cnt
        metrics[f"positions/step{r}"] = jnp.sum(w_bm)
    # does step r repeat step r-1's guess (draft), and how often does the text itself (teacher)?
    trained_rbm = jnp.stack(trained)
    dup_r = step_duplication_rate(jax.lax.stop_gradient(jnp.stack(draft_top1)), trained_rbm)
    text_dup_r = step_duplication_rate(jnp.stack(teacher_top1), trained_rbm)
    for r in range(1, r_steps):
        metrics[f"dup_rate/step{r}"] = dup_r[r - 1]
        metrics[f"dup_rate_teacher/step{r}"] = text_dup_r[r - 1]
    return loss, metrics, jnp.stack(correct), jnp.stack(answer), jnp.stack(in_draft)


def _chain_metrics(correct, answer, in_draft, sel_bm, ok_bm, base_bn, loss_mask_bn, cfg: ObjectiveConfig,
                   prefix: str = "") -> dict:
    """Conditional accuracy per TTT step and (every index drafted: EAGLE-3, ConFu's evaluation form)
    the decode-path τ at chain depths 1..L_ttt, from the per-step hits of :func:`_ttt_losses`."""
    correct = jax.lax.stop_gradient(correct)
    starts = _pick(sel_bm, base_bn) & ok_bm
    cond_r = conditional_step_accuracy(correct, answer, in_draft, starts)
    metrics = {f"{prefix}cond_acc/step{r}": cond_r[r] for r in range(cfg.ttt_steps)}
    if sel_bm is None:  # walk the decode path
        for depth in range(1, cfg.ttt_steps + 1):
            metrics[f"{prefix}decode_tau/chain{depth}"] = decode_path_acceptance_length(
                correct, answer, in_draft, base_bn & ok_bm, loss_mask_bn, depth)
    return metrics


FUTURE_PROBE_AHEAD = (1, 2, 3)  # f's top-1 is compared with x[t+s] for these s


def future_probe_metrics(spec: ModelSpec, trainable: dict, target_params: dict, tokens_bn, loss_mask_bn, rows,
                         h_cat_bnc, teacher, masks, plan: AnchorPlan, f_bkd, sel_bm, ok_bm, base_bn,
                         cfg: ObjectiveConfig, future_weight_rbnh=None) -> dict:
    """What ConFu's future entry is worth to its draft, and what it carries (evaluation only).

    * ``no_future/decode_tau/chain{D}``, ``no_future/cond_acc/step{r}``: the same draft weights
      drafting **without** the future entry (``draft_ttt(future=None)``: the EAGLE-3 forward), on the
      same starting points. Equal to the metrics with the entry means the head ignores its future
      (docs/RESULTS.md's decode ablation measures the same thing in the loop).
    * ``future/f_top1_x{s}``: the share of anchors t whose f[t], read by the target's own LM head,
      has top-1 x[t+s] (s = 1: the bonus the draft already gets as input; s = 2: the first drafted
      token, what a pause token at t+1 would predict; s = 3: one further), counted where x[t+s] is
      an answer token of t's conversation. Beside ``acc/step0`` (the draft's own accuracy on x[t+2]):
      an f that predicts x[t+2] worse than the draft already does adds little.
    * ``future/attn_weight/step{r}``: the softmax weight TTT step r's queries give the future entry,
      averaged over query heads and the starting points (``draft_ttt(future_weights=True)``). Beside
      1 / (keys a query sees) it says whether the entry is attended at all; a weight near 0 also
      means a gradient near 0 for everything behind it (f, MoE_f, the soft prompts).
    """
    no_future = draft_ttt(spec, trainable["draft"], target_params["embed"]["embedding"], tokens_bn, h_cat_bnc,
                          cfg.ttt_steps, positions_bn=rows.positions_bn, future=None, return_logits=False,
                          segment_ids_bn=rows.segment_ids_bn)
    _, _, correct, answer, in_draft = _ttt_losses(spec, trainable["draft"], no_future, teacher, masks,
                                                  sel_bm, ok_bm, tokens_bn.shape[1], cfg)
    metrics = _chain_metrics(correct, answer, in_draft, sel_bm, ok_bm, base_bn, loss_mask_bn, cfg, "no_future/")
    w, axis = lm_head_layout(spec, target_params)
    f_lm = future_readout(spec, target_params, jax.lax.stop_gradient(f_bkd))
    f_top1_bk, f_lse_bk = full_vocab_argmax_lse(f_lm, w, axis, cfg.vocab_chunk)
    # f's cross-entropy on the tokens ahead (future/aux_ce_x*), from the same vocabulary scan
    metrics.update(future_aux_loss(spec, target_params, f_lm, tokens_bn, loss_mask_bn, rows,
                                   plan, cfg.future_aux_ahead, cfg.vocab_chunk, lse_bk=f_lse_bk)[1])
    b_idx = jnp.arange(tokens_bn.shape[0])[:, None]
    for s in FUTURE_PROBE_AHEAD:
        ahead = shift_ahead(loss_mask_bn.astype(bool), s, False)
        if rows.segment_ids_bn is not None:
            ahead = ahead & same_segment_ahead(rows.segment_ids_bn, s)
        ok_bk = plan.valid_bk & ahead[b_idx, plan.anchor_bk]
        hit_bk = f_top1_bk == shift_ahead(tokens_bn, s, -1)[b_idx, plan.anchor_bk]
        w_bk = ok_bk.astype(jnp.float32)
        metrics[f"future/f_top1_x{s}"] = jnp.sum(hit_bk * w_bk) / jnp.maximum(jnp.sum(w_bk), 1.0)
    if future_weight_rbnh is not None:
        starts = (_pick(sel_bm, base_bn) & ok_bm).astype(jnp.float32)
        n_starts = jnp.maximum(jnp.sum(starts), 1.0)
        for r in range(future_weight_rbnh.shape[0]):
            w_bm = _pick(sel_bm, jnp.mean(future_weight_rbnh[r], axis=-1))
            metrics[f"future/attn_weight/step{r}"] = jnp.sum(w_bm * starts) / n_starts
    return metrics


def future_aux_loss(spec: ModelSpec, target_params: dict, f_bkd: jax.Array, tokens_bn: jax.Array,
                    loss_mask_bn: jax.Array, rows, plan: AnchorPlan, ahead: int, vocab_chunk: int,
                    lse_bk: Optional[jax.Array] = None):
    """(loss, metrics): cross-entropy of f[t], read by the target's frozen final norm and LM head, against
    x[t+1+s] for s = 1..``ahead`` (not the paper's; ``objective.future_aux_weight``).

    The paper trains the soft prompts and the contemplate MoE only through the draft's loss, i.e.
    through the attention the draft gives its future entry — and an ignored entry passes back no
    gradient (docs/RESULTS.md "Why ConFu ignores its future"). This loss reaches f whatever the draft
    attends, as BiTA trains its prompt tokens: it makes f name the tokens the draft is about to draft
    (``f_bkd`` as the LM head reads it: ``models.target.future_readout`` of the contemplate's f).
    Its gradient reaches the contemplate path only (soft prompts, MoE_con): the draft's parameters and
    the frozen target do not enter it. Terms count where x[t+1+s] is an answer token of t's
    conversation; the loss is their mean over valid anchors and s. The log-sum-exp runs over vocabulary
    chunks (:func:`full_vocab_argmax_lse`), so [B, K, V] logits never exist at once.
    """
    w, axis = lm_head_layout(spec, target_params)
    if lse_bk is None:  # (the evaluation probe passes the one it already has)
        _, lse_bk = full_vocab_argmax_lse(f_bkd, w, axis, vocab_chunk)
    b_idx = jnp.arange(tokens_bn.shape[0])[:, None]
    total, count, metrics = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), {}
    for s in range(1, ahead + 1):
        ok_bn = shift_ahead(loss_mask_bn.astype(bool), 1 + s, False)
        if rows.segment_ids_bn is not None:
            ok_bn = ok_bn & same_segment_ahead(rows.segment_ids_bn, 1 + s)
        ok_bk = (plan.valid_bk & ok_bn[b_idx, plan.anchor_bk]).astype(jnp.float32)
        y_bk = jnp.maximum(shift_ahead(tokens_bn, 1 + s, 0)[b_idx, plan.anchor_bk], 0)
        rows_bkd = jnp.take(w, y_bk, axis=0) if axis == 0 else jnp.moveaxis(jnp.take(w, y_bk, axis=1), 0, -1)
        if rows_bkd.dtype != f_bkd.dtype:
            rows_bkd, f_c = rows_bkd.astype(jnp.float32), f_bkd.astype(jnp.float32)
        else:
            f_c = f_bkd
        logit_bk = jnp.einsum("bkd,bkd->bk", f_c, rows_bkd, preferred_element_type=jnp.float32)
        ce_bk = lse_bk - logit_bk
        n_s = jnp.sum(ok_bk)
        metrics[f"future/aux_ce_x{1 + s}"] = jnp.sum(ce_bk * ok_bk) / jnp.maximum(n_s, 1.0)
        total, count = total + jnp.sum(ce_bk * ok_bk), count + n_s
    loss = total / jnp.maximum(count, 1.0)
    metrics["future/aux_loss"] = loss
    return loss, metrics


def future_aux_scale(cfg: ObjectiveConfig, step) -> jax.Array:
    """The auxiliary loss's weight at optimizer step ``step`` (None: evaluation, the full weight)."""
    w = jnp.asarray(cfg.future_aux_weight, jnp.float32)
    if cfg.future_aux_anneal_steps <= 0 or step is None:
        return w
    return w * jnp.clip(1.0 - jnp.asarray(step, jnp.float32) / cfg.future_aux_anneal_steps, 0.0, 1.0)


def confu_loss(spec: ModelSpec, trainable: dict, target_params: dict, draft_vocab: dict, batch: dict,
               rng: jax.Array, cfg: ObjectiveConfig) -> tuple[jax.Array, dict]:
    """(loss, metrics) of ``trainable = {'draft', 'confu'}`` on a batch (see module doc).

    ``batch``: 'tokens' int [B,N], 'loss_mask' bool [B,N] (the token at that position is an answer
    token to predict), optional 'attention_mask' bool [B,N] (right padding); packed rows add
    'segment_ids' int [B,N] (1, 2, ... per conversation, 0 = padding) and optionally 'positions'
    (default: index − segment start), see :class:`RowLayout`. Offline target features
    (``launch.target_features``, EAGLE-3 only) add the :data:`OFFLINE_KEYS` ('h_cat' [B,N,3d] and
    the stored teacher), and the target pass is skipped. ``draft_vocab``:
    ``{'d2t', 't2d'}``. ``rng`` draws the anchors and lags (unused by EAGLE-3). Gradients reach
    only ``trainable``: the target and its embedding enter under ``stop_gradient``. An optional
    'step' (the optimizer step, added by the train step) anneals ``cfg.future_aux_weight``.
    """
    tokens_bn, loss_mask_bn = batch_arrays(batch)
    rows = row_layout(batch)
    b, n = tokens_bn.shape
    target_params = jax.lax.stop_gradient(target_params)

    if "h_cat" in batch and spec.head.has_future:  # offline target features: no target forward (EAGLE-3 only)
        raise ValueError(f"confu_loss: the batch carries offline target features ('h_cat'), which only "
                         f"EAGLE-3 can use; {spec.head.variant} needs the target's per-layer K/V for its "
                         "contemplates and recomputes them (docs/DESIGN.md §4 'Offline target features')")
    h_cat_bnc, teacher, out = taps_and_teacher(spec, target_params, draft_vocab, batch, tokens_bn, rows,
                                               cfg.vocab_chunk, "confu_loss")

    future, plan = None, None
    if spec.head.has_future:
        plan = plan_anchors(rng, loss_mask_bn, cfg, rows if rows.segment_ids_bn is not None else None)
        b_idx = jnp.arange(b)[:, None]
        packed = {} if rows.segment_ids_bn is None else dict(
            anchor_positions_bk=rows.positions_bn[b_idx, plan.anchor_bk],
            segment_start_bk=rows.segment_start_bn[b_idx, plan.anchor_bk])
        f_bkd = contemplate_queries(spec, target_params, trainable["confu"], to_cache_layout(out.k_new_lbthd),
                                    to_cache_layout(out.v_new_lbthd),
                                    plan.anchor_bk, h_cat_bnc[b_idx, plan.con_src_bk], **packed)
        future = TTTFuture(pin_rows(f_bkd), plan.anchor_bk, plan.index_bn)
    ttt = draft_ttt(spec, trainable["draft"], target_params["embed"]["embedding"], tokens_bn, h_cat_bnc,
                    cfg.ttt_steps, positions_bn=rows.positions_bn, future=future, return_logits=False,
                    segment_ids_bn=rows.segment_ids_bn, future_weights=cfg.future_probe and future is not None,
                    remat_mlp=cfg.remat_mlp)
    masks = ttt_masks(loss_mask_bn, teacher.in_draft_bn, cfg.ttt_steps, rows.segment_ids_bn)
    # verification starting points for the simulated τ: the bonus x[j+1] and the first drafted
    # token x[j+2] are answer tokens (the anchor candidates), for every variant alike
    sel_bm, ok_bm, base_bn = _trained_positions(plan, anchor_candidates(loss_mask_bn, rows.segment_ids_bn), n, cfg)
    loss, metrics, correct, answer, in_draft = _ttt_losses(spec, trainable["draft"], ttt, teacher, masks,
                                                           sel_bm, ok_bm, n, cfg)
    metrics["acceptance_length"] = simulated_acceptance_length(
        jax.lax.stop_gradient(correct), answer, in_draft, _pick(sel_bm, base_bn) & ok_bm)
    metrics.update(_chain_metrics(correct, answer, in_draft, sel_bm, ok_bm, base_bn, loss_mask_bn, cfg))
    if cfg.future_probe and future is not None:
        metrics.update(future_probe_metrics(spec, trainable, target_params, tokens_bn, loss_mask_bn, rows,
                                            h_cat_bnc, teacher, masks, plan, f_bkd, sel_bm, ok_bm, base_bn, cfg,
                                            jax.lax.stop_gradient(ttt.future_weight_rbnh)))
    answer_w = loss_mask_bn.astype(jnp.float32)
    n_ans = jnp.maximum(jnp.sum(answer_w), 1.0)
    metrics["teacher/draft_vocab_mass"] = jnp.sum(teacher.draft_mass_bn * answer_w) / n_ans
    metrics["teacher/argmax_in_draft"] = jnp.sum(teacher.in_draft_bn * answer_w) / n_ans
    if future is not None and cfg.future_aux_weight > 0:  # (evaluation reports it through the probe)
        aux, aux_metrics = future_aux_loss(spec, target_params, future_readout(spec, target_params, f_bkd),
                                           tokens_bn, loss_mask_bn, rows, plan, cfg.future_aux_ahead, cfg.vocab_chunk)
        metrics.update(aux_metrics)
        scale = future_aux_scale(cfg, batch.get("step"))
        metrics["future/aux_weight"] = scale
        loss = loss + scale * aux
    if plan is not None:
        metrics["anchors/valid"] = jnp.mean(jnp.sum(plan.valid_bk, axis=1).astype(jnp.float32))
        metrics["anchors/window_coverage"] = jnp.sum((plan.index_bn >= 0) * answer_w) / n_ans
    return loss, metrics
