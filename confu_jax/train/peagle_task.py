"""P-EAGLE training: COD rollouts on the frozen target's taps (arXiv 2602.01469; docs/DESIGN.md §11 "P-EAGLE").

The reference is speculators' ``PEagleDraftModel.forward`` (``models/peagle/core.py``), its sampling
``generate_cod_sample_indices`` (``data.py``), its mask ``create_peagle_mask_mod`` (``attention.py``) and its
loss (``metrics.py``: the compound loss, KL to the target by default, a plain mean over the trained slots).
In this project's index convention (draft entry j = token x[j+1], target features h_cat[j], at position j;
it predicts x[j+2], whose teacher is the target's distribution at j+1 — EAGLE-3's step 0):

* **depth 0** is every position of the row, as EAGLE-3's first TTT step: causal among themselves;
* **depth k ≥ 1** (k < ``num_depths``): a rollout from anchor a adds the slot (mask token, ``mask_hidden``
  through the head's norms and fc) at position a+k, attending the depth-0 entries j ≤ a and the slots of
  its own rollout of depth ≤ k; it predicts x[a+k+2] (teacher row a+k+1) — what the one-pass draft at
  p = a asks of slot k (``decode.peagle``);
* **COD sampling** (conditional drop: depth k keeps a fraction max(r^k, r_min) of the rollouts, nested:
  a rollout kept at depth k is kept at every depth below). Static shapes: ``num_anchors`` anchors a row,
  drawn uniformly without replacement among the positions t with x[t+1], x[t+2] answer tokens (the
  situation the draft meets at inference), put in a random order; depth k holds the first
  n_k = ceil(num_anchors · max(r^k, r_min)) of them. The reference's depth 0 keeps every position and
  depth k about N·max(r^k, r_min): with ``num_anchors`` = N the counts are the reference's; fewer anchors
  cost less (one forward over N + Σ n_k slots);
* **loss**: KL(target ‖ draft) over the draft vocabulary (the EAGLE-3 teacher, ``train.teacher``) averaged
  over every trained slot — depth 0's (x[j+2] an answer token whose target argmax has a draft id) and the
  kept rollouts' (x[a+k+2] likewise) — as the reference's ``compound_loss`` with its default ``kl_div``.

Departure: the mask token's embedding (and every other) is the target's, frozen, as this project's EAGLE-3
heads train; the reference trains the draft's copy (``embed_requires_grad``). Imported heads that trained
theirs keep it (``weights.peagle_format``).

Metrics: ``loss/depth{k}``, ``acc/depth{k}`` (top-1 agreement with the target), ``positions/depth{k}``, and
``acceptance_length`` — 1 + the mean leading run of right depths over the rollouts kept to the last depth:
what a greedy ``chain:num_depths`` accepts there when the text is the target's own greedy output.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from confu_jax.models.draft import draft_features
from confu_jax.models.draft_decode import draft_block
from confu_jax.models.spec import ModelSpec
from confu_jax.train.loss import anchor_candidates, ttt_masks
from confu_jax.train.rows import batch_arrays, row_layout, sample_anchors, shift_ahead
from confu_jax.train.teacher import taps_and_teacher


def default_peagle_config() -> ml_collections.ConfigDict:
    """``config.peagle`` (speculators' ``get_trainer_kwargs`` defaults where it has one)."""
    c = ml_collections.ConfigDict()
    c.num_depths = 8  # K: the rollout's slots, depth 0 included (the proposal's speculative tokens)
    c.down_sample_ratio = 0.7  # r: depth k keeps max(r^k, r_min) of the rollouts
    c.down_sample_ratio_min = 0.2  # r_min
    c.num_anchors = 256  # rollouts a row (the reference: every position; fewer is cheaper)
    return c


def apply_peagle_defaults(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A head config (``configs.common.base_config(..., 'peagle')``) turned into a P-EAGLE run: this task,
    ``config.peagle``, and no TTT (P-EAGLE trains without it)."""
    config.train.task = "peagle"  # train.tasks.TASKS
    config.peagle = default_peagle_config()
    return config


@dataclasses.dataclass(frozen=True)
class PEagleObjective:
    num_depths: int = 8
    ratio: float = 0.7
    ratio_min: float = 0.2
    num_anchors: int = 256
    vocab_chunk: int = 8192

    def __post_init__(self):
        if self.num_depths < 2 or not 0 < self.ratio_min <= 1 or not 0 < self.ratio <= 1 or self.num_anchors < 1:
            raise ValueError(f"config.peagle: need num_depths >= 2, 0 < down_sample_ratio(_min) <= 1, "
                             f"num_anchors >= 1; got {self}")

    def kept(self, n_anchors: int) -> tuple:
        """n_k: rollouts kept at depth k = 1..K-1 (nested, non-increasing, at least 1)."""
        return tuple(max(1, math.ceil(n_anchors * max(self.ratio ** k, self.ratio_min)))
                     for k in range(1, self.num_depths))


def objective_from_config(config) -> PEagleObjective:
    p = config.peagle
    return PEagleObjective(int(p.num_depths), float(p.down_sample_ratio), float(p.down_sample_ratio_min),
                           int(p.num_anchors), int(config.objective.vocab_chunk))


def rollout_slots(cfg: PEagleObjective, n_anchors: int):
    """The static slot layout: (slot's anchor rank [M], slot's depth [M]) for the kept rollouts."""
    ranks, depths = [], []
    for k, n_k in enumerate(cfg.kept(n_anchors), start=1):
        ranks += range(n_k)
        depths += [k] * n_k
    return np.asarray(ranks, np.int32), np.asarray(depths, np.int32)


def cod_mask(anchor_bm: jax.Array, rank_m: jax.Array, depth_m: jax.Array, n: int) -> jax.Array:
    """[B, N+M, N+M] bool: who each query sees (``create_peagle_mask_mod`` on this layout): depth 0 is
    causal; a slot sees the depth-0 entries up to its anchor and its rollout's slots of lower or equal depth."""
    b, m = anchor_bm.shape
    j = jnp.arange(n)
    top = jnp.concatenate([jnp.broadcast_to(j[:, None] >= j[None, :], (b, n, n)), jnp.zeros((b, n, m), bool)], 2)
    ctx = j[None, None, :] <= anchor_bm[:, :, None]  # [B,M,N]
    own = (rank_m[:, None] == rank_m[None, :]) & (depth_m[None, :] <= depth_m[:, None])  # [M,M]
    bottom = jnp.concatenate([ctx, jnp.broadcast_to(own, (b, m, m))], 2)
    return jnp.concatenate([top, bottom], 1)


def cod_forward(spec: ModelSpec, draft: dict, embed_vd: jax.Array, tokens_bn: jax.Array, h_cat_bnc: jax.Array,
                anchor_bm: jax.Array, rank_m: jax.Array, depth_m: jax.Array) -> jax.Array:
    """The draft's logits [B, N+M, V_d] over a row's depth-0 entries and its M rollout slots (slot m: the
    rollout of rank ``rank_m[m]`` from anchor ``anchor_bm[:, m]`` at depth ``depth_m[m]``), in one forward."""
    b, n = tokens_bn.shape
    m = rank_m.shape[0]
    g_bnd = draft_features(spec, draft, h_cat_bnc)
    g_mask = draft_features(spec, draft, draft["mask_hidden"][None, None])  # [1,1,d]
    toks = jnp.concatenate([shift_ahead(tokens_bn, 1, 0), jnp.full((b, m), spec.head.mask_token_id, jnp.int32)], 1)
    hidden = jnp.concatenate([g_bnd, jnp.broadcast_to(g_mask, (b, m, g_bnd.shape[-1])).astype(g_bnd.dtype)], 1)
    pos = jnp.concatenate([jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n)), anchor_bm + depth_m[None]], 1)
    return draft_block(spec, draft, embed_vd, toks, hidden, pos,
                       block_mask_btt=cod_mask(anchor_bm, rank_m, depth_m, n)).logits_btv


def peagle_loss(spec: ModelSpec, trainable: dict, target_params: dict, draft_vocab: dict, batch: dict,
                rng: jax.Array, cfg: PEagleObjective) -> tuple[jax.Array, dict]:
    """(loss, metrics) of a P-EAGLE head (``trainable['draft']`` with ``mask_hidden``) on a batch of padded
    rows (module docstring); offline target features (``launch.target_features``) skip the target pass."""
    if not spec.head.parallel:
        raise ValueError(f"peagle_loss: a P-EAGLE head (variant 'peagle'); got {spec.head.variant!r}")
    tokens_bn, loss_mask_bn = batch_arrays(batch)
    rows = row_layout(batch)
    if rows.segment_ids_bn is not None:
        raise ValueError("peagle_loss: packed rows (segment_ids) are not supported; turn config.data.pack off")
    b, n = tokens_bn.shape
    target_params = jax.lax.stop_gradient(target_params)
    h_cat_bnc, teacher, _ = taps_and_teacher(spec, target_params, draft_vocab, batch, tokens_bn, rows,
                                             cfg.vocab_chunk, "peagle_loss")
    depths = cfg.num_depths
    masks = ttt_masks(loss_mask_bn, teacher.in_draft_bn, depths)  # (depth k, index j): teacher row j+1+k
    # rollouts: anchors among the inference-like positions, in a random order (valid ones first)
    a_rng, o_rng = jax.random.split(rng)
    n_anchors = min(cfg.num_anchors, n)
    anchor_bk, valid_bk = sample_anchors(a_rng, anchor_candidates(loss_mask_bn), n_anchors)
    order = jnp.argsort(jnp.where(valid_bk, 0.0, 2.0) + jax.random.uniform(o_rng, valid_bk.shape), axis=1)
    anchor_bk, valid_bk = (jnp.take_along_axis(x, order, axis=1) for x in (anchor_bk, valid_bk))
    rank_np, depth_np = rollout_slots(cfg, n_anchors)
    rank_m, depth_m = jnp.asarray(rank_np), jnp.asarray(depth_np)
    anchor_bm, valid_bm = anchor_bk[:, rank_m], valid_bk[:, rank_m]
    embed = jax.lax.stop_gradient(target_params["embed"]["embedding"])
    logits = cod_forward(spec, trainable["draft"], embed, tokens_bn, h_cat_bnc, anchor_bm, rank_m, depth_m)
    logq = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, N+M, V_d]
    # teacher rows and trained slots: depth 0 at j -> row j+1; slot (a, k) -> row a+k+1
    idx = jnp.concatenate([jnp.broadcast_to(jnp.arange(n), (b, n)) + 1, anchor_bm + depth_m[None] + 1], 1)
    v_d = teacher.logp_bnv.shape[-1]
    t_pad = jnp.concatenate([teacher.logp_bnv, jnp.zeros((b, depths + 1, v_d), jnp.float32)], 1)
    t_lp = jnp.take_along_axis(t_pad, idx[..., None], axis=1)
    kl = jnp.sum(jnp.exp(t_lp) * (t_lp - logq), axis=-1)  # [B, N+M]
    bi = jnp.arange(b)[:, None]
    trained = jnp.concatenate([masks.valid_rbn[0], masks.valid_rbn[depth_m[None], bi, anchor_bm] & valid_bm], 1)
    w = trained.astype(jnp.float32)
    loss = jnp.sum(kl * w) / jnp.maximum(jnp.sum(w), 1.0)
    hit = jnp.argmax(logq, -1) == jnp.argmax(t_lp, -1)
    depth_all = jnp.concatenate([jnp.zeros((n,), jnp.int32), depth_m])
    metrics = {"loss": loss}
    for k in range(depths):
        wk = w * (depth_all == k)[None]
        cnt = jnp.maximum(jnp.sum(wk), 1.0)
        metrics[f"loss/depth{k}"] = jnp.sum(kl * wk) / cnt
        metrics[f"acc/depth{k}"] = jnp.sum(hit * wk) / cnt
        metrics[f"positions/depth{k}"] = jnp.sum(wk)
    metrics["acceptance_length"] = _rollout_acceptance(hit, trained, anchor_bk, valid_bk, depth_np, n, cfg)
    return loss, metrics


def _rollout_acceptance(hit, trained, anchor_bk, valid_bk, depth_np: np.ndarray, n: int, cfg: PEagleObjective):
    """1 + the mean leading run of right depths (depth 0 at the anchor, then its slots) over the rollouts
    kept to the last depth whose every depth is trained (a run stops at the first wrong one)."""
    n_full = cfg.kept(anchor_bk.shape[1])[-1]
    b = hit.shape[0]
    bi = jnp.arange(b)[:, None]
    a = anchor_bk[:, :n_full]
    rows_hit = [hit[bi, a]]
    rows_ok = [trained[bi, a]]
    for k in range(1, cfg.num_depths):
        col = n + np.nonzero(depth_np == k)[0][:n_full]
        rows_hit.append(hit[:, col])
        rows_ok.append(trained[:, col])
    h, ok = jnp.stack(rows_hit, -1), jnp.stack(rows_ok, -1)  # [B, n_full, K]
    full = jnp.all(ok, -1) & valid_bk[:, :n_full]
    run = jnp.sum(jnp.cumprod(h.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.float32)
    return 1.0 + jnp.sum(run * full) / jnp.maximum(jnp.sum(full), 1.0)


def build_task(config):
    """The TrainTask of a P-EAGLE config (``configs/tiny_peagle.py``, ``configs/smollm2_peagle.py``): the
    head task's target, data and draft vocabulary (``train.confu_task.build_head_task``) with this loss."""
    from confu_jax.train.confu_task import build_head_task

    obj = objective_from_config(config)

    def losses(spec, draft_vocab):
        def loss_fn(trainable, frozen, batch, rng):
            return peagle_loss(spec, trainable, frozen, draft_vocab, batch, rng, obj)

        def eval_fn(trainable, frozen, batch, rng):
            return loss_fn(trainable, frozen, batch, rng)[1]  # the metrics hold the loss

        return loss_fn, eval_fn

    return build_head_task(config, losses,
                           f"P-EAGLE: {obj.num_depths} depths, COD r={obj.ratio} (min {obj.ratio_min}), "
                           f"{obj.num_anchors} rollouts a row")
