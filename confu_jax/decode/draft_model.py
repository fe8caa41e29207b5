"""Independent draft models (Leviathan et al., Chen et al.) and SD² steering as a ``Drafter``.

Any Llama that shares the target's tokenizer drafts with **its own KV cache** inside the same
jitted loop (docs/DESIGN.md §11 "Independent draft models and SD²"). Its architecture is
``DrafterParams.draft_model`` (a ``LlamaConfig``, static), its weights ``DrafterParams.weights['model']``;
with no ``'model'`` entry the drafter is the **early-exit self-drafter**: the target's first N layers
(N = ``draft_model.n_layers``) with the target's final norm and LM head, read from the
target's own parameters (no copy; on the layer-unrolled CPU path the target's per-layer buffers).

**State** (``DraftModelState``, per row): the draft cache holds the draft's K/V of positions
0..c-1 (c = its length), and the **pending** tokens x[c..p+1] — the tokens the last verification
emitted (accepted drafts, then the bonus = the next root), at most A = D+1 — wait to be fed.
After the prompt (``init``: one causal block over the prompt) the pending token is the first
emitted token.

**One round** (``propose``): depth 0 feeds the pending block (causal, against the cache) and
commits it — the cache then holds 0..p+1 — and its output at the root scores the root's children.
Deeper nodes:

* chains (``chain:K``, ``sampled_chain:K``): the node at depth k (position p+1+k) attends the cache
  plus its ancestors, whose K/V the previous depths wrote to the cache slots p+2..p+k **beyond**
  the committed length (slot i = position i; the length does not move, so the next round
  overwrites them): one token per depth;
* trees (static, EAGLE-2 ``dynamic``): every depth **recomputes the block of all nodes expanded so
  far** (scratch slots 1..o+K of ``decode.tree``'s frontier contract) under their ancestor mask,
  against the cache: a node sees the cache and its ancestors, never its siblings. A depth-k call
  costs the nodes expanded up to k instead of the frontier alone (documented trade: the Llama
  forward has no per-row scratch keys).

Accepted drafts are re-fed next round instead of keeping their draft-time K/V (simpler, and the
pending block is at most D+1 tokens).

On the layer-unrolled CPU path (the loop hands the target in as ``SplitParams``) the early-exit
drafter reads the target's own per-layer buffers; an independent model's stacked layers are split
once per generation too, outside the ``while_loop`` (``DraftModel.prepare_params``), so the loop
body reads per-layer buffers instead of slicing the stack every iteration.

**SD²** (``steered=True``, ``models.steering``): the steering vector g is computed from h_cat at the
last accepted node of the previous verification (``update``) and is fixed for the whole round: every
layer's MLP gets the bias W_s^l g. The pending tokens before the root were drafted under the
previous round's g, so the depth-0 block gives them that bias (their K/V are what they were at
draft time in the paper) and the root the new one. An untrained (zero W_s) steered drafter equals
the unsteered one exactly.

The draft's vocabulary must be the target's (ids equal: ``runs.draft_models.check_tokenizers``); an embedding padded
past the tokenizer's size is cut to the target's vocabulary (and a shorter one padded with -inf),
so q is over target ids and every rule of §4 applies (greedy, sequential residual for top-k
trees, Leviathan's for ``sampled_chain`` with the q the chain was sampled from).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp

from confu_jax.decode import tree as tree_lib
from confu_jax.decode.drafter import DraftInput, PlanDrafter, PrefillView, Proposal, VerifiedPass, full_proposal
from confu_jax.decode.family import DrafterFamily, Method
from confu_jax.decode.loaded import LoadedDrafter, own_weights
from confu_jax.decode.plans import DraftPlan, parse_plan
from confu_jax.models import steering as steer_lib
from confu_jax.models.early_exit import early_exit_params, is_early_exit_of
from confu_jax.models.kv_cache import KVCache, commit, init_cache
from confu_jax.models.llama import LlamaConfig, LlamaOutput
from confu_jax.models.vocab_map import to_target_vocab
from confu_jax.models.unrolled import SplitParams, apply_target, split_layers, target_logits
from confu_jax.kernels.attention_reference import AttendTo

# ----------------------------------------------------------------------------- state


@flax.struct.dataclass(kw_only=True)
class DraftModelState:
    """What an independent draft model keeps between iterations (module docstring)."""

    draft_cache: KVCache  # [L_d, B, Hkv_d, S, hd_d] (per-layer buffers on the unrolled path); length c
    pending_tokens_ba: jax.Array  # [B, A] int32 tokens x[c..p+1] not yet fed (the last one = the root)
    pending_count_b: jax.Array  # [B] int32 valid pending tokens (>= 1)
    # SD² only (None otherwise): h_cat at the last accepted node, g's source for the next round
    steer_src_bc: Optional[jax.Array] = None  # [B, 3d]
    # SD² only: the MLP bias W_s^l g of the last round (the pending non-root tokens were drafted under it)
    steer_bias_lbf: Optional[jax.Array] = None  # [L_d, B, F_d] float32


# ----------------------------------------------------------------------------- the model


def draft_config(dp) -> LlamaConfig:
    if dp.draft_model is None:
        raise ValueError("these drafter params have no draft model (DrafterParams.draft_model is None): build them "
                         "with decode.families.decode_head('draft_model', ...) or DrafterParams(..., draft_model=cfg)")
    return dp.draft_model


def draft_weights(target, dp):
    """(draft LlamaConfig, draft weights in the target's layout): ``dp.weights['model']``, or the
    target's first layers (early exit). On the layer-unrolled path (the loop split the target into
    ``SplitParams``) an independent model's stack is split too (``models.unrolled``): already, by
    ``DraftModel.prepare_params`` outside the loop, or here for callers that skipped it."""
    cfg = draft_config(dp)
    model = (dp.weights or {}).get("model")
    if model is None:
        if not is_early_exit_of(cfg, target.config):
            raise ValueError(f"drafter_params.weights has no 'model': the early-exit drafter needs draft_model = the "
                             f"target's config with fewer layers; got {cfg} for target {target.config}")
        return cfg, early_exit_params(target.params, cfg.n_layers)
    if isinstance(target.params, SplitParams) and not isinstance(model, SplitParams):
        return cfg, split_layers(model, cfg)
    return cfg, model


def forward(cfg: LlamaConfig, weights, tokens_bt, positions_bt, *, cache: Optional[KVCache] = None,
            cache_len_bt=None, block_mask_btt=None, mlp_bias_lbtf=None) -> LlamaOutput:
    """The draft model over a block (no logits; ``logits`` on the rows that need them)."""
    attend = AttendTo(mask=block_mask_btt)
    if cache is not None:
        attend = AttendTo(mask=block_mask_btt, k_cache=cache.k_lbhsd, v_cache=cache.v_lbhsd,
                          cache_len=cache.length_b if cache_len_bt is None else cache_len_bt)
    return apply_target(weights, cfg, tokens_bt, positions_bt, attend=attend, return_logits=False,
                        mlp_bias_lbtf=mlp_bias_lbtf)


def logits(cfg: LlamaConfig, weights, hidden_xd, vocab: int) -> jax.Array:
    """Float32 logits over the target's vocabulary (``vocab`` ids) from final-normed hidden states."""
    return to_target_vocab(target_logits(weights, cfg, hidden_xd), vocab)


def _steering(dp, c: int, cfg: LlamaConfig) -> dict:
    st = (dp.weights or {}).get("steering")
    if st is None:
        raise ValueError("an SD² (steered) drafter needs drafter_params.weights['steering'] (models.steering.init_steering, "
                         "or a trained launch.train SD² workdir)")
    steer_lib.check_steering(st, c, cfg)
    return st


# ----------------------------------------------------------------------------- the drafter


@dataclasses.dataclass(frozen=True)
class DraftModel(PlanDrafter):
    """An independent draft model (``DrafterParams.draft_model``, weights ``['model']`` or the
    target's first layers) drafting the trees of ``plan`` (chain, sampled chain, static or EAGLE-2
    dynamic tree; no contemplates). ``steered``: SD² steering from the verifier's taps."""

    plan: DraftPlan
    steered: bool = False
    what = "a draft model"

    def prepare_params(self, target, dp):
        """On the unrolled path, split an independent model's layer stack once (``draft_weights``)."""
        model = (dp.weights or {}).get("model")
        if model is None or not isinstance(target.params, SplitParams) or isinstance(model, SplitParams):
            return dp
        return dp.replace(weights={**dp.weights, "model": draft_weights(target, dp)[1]})

    # ------------------------------------------------------------------ init

    def init(self, target, dp, view: PrefillView) -> DraftModelState:
        """The prompt as one causal block (positions 0..n-1 committed); the pending token is the
        first emitted one. SD²: prompt position j is steered by g[j-1] (offset 1; g[0] at j = 0)."""
        cfg, w = draft_weights(target, dp)
        b, width = view.tokens_bt.shape
        a = self.max_depth + 1
        pos = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (b, width))
        rows = jnp.arange(b)
        steer_src = steer_bias = mlp_bias = None
        if self.steered:
            st = _steering(dp, view.h_cat_btc.shape[-1], cfg)
            src = jnp.concatenate([view.h_cat_btc[:, :1], view.h_cat_btc[:, :-1]], axis=1)  # h_cat[max(j-1, 0)]
            mlp_bias = steer_lib.bias_from_taps(st, src)  # [L,B,W,F]
            steer_src = view.h_cat_btc[rows, view.lengths_b - 1]
            steer_bias = steer_lib.bias_from_taps(st, view.h_cat_btc[rows, jnp.maximum(view.lengths_b - 2, 0)])
        out = forward(cfg, w, view.tokens_bt, pos, mlp_bias_lbtf=mlp_bias)
        cache = init_cache(cfg.n_layers, b, view.max_len, cfg.n_kv_heads, cfg.head_dim, jnp.dtype(cfg.dtype),
                           per_layer=isinstance(w, SplitParams))
        cache = commit(cache, out.k_new_lbthd, out.v_new_lbthd, view.lengths_b)
        return DraftModelState(
            draft_cache=cache,
            pending_tokens_ba=jnp.zeros((b, a), jnp.int32).at[:, 0].set(view.first_b.astype(jnp.int32)),
            pending_count_b=jnp.ones((b,), jnp.int32),
            steer_src_bc=steer_src, steer_bias_lbf=steer_bias)

    # ------------------------------------------------------------------ propose

    def propose(self, target, dp, st: DraftModelState, inp: DraftInput) -> Proposal:
        cfg, w = draft_weights(target, dp)
        vocab = target.config.vocab_size
        b, a = st.pending_tokens_ba.shape
        rows = jnp.arange(b)
        active = ~inp.done_b
        bias_new = None
        if self.steered:
            steering = _steering(dp, st.steer_src_bc.shape[-1], cfg)
            bias_new = steer_lib.bias_from_taps(steering, st.steer_src_bc)  # [L,B,F]: fixed for the round
        round_bias = None if bias_new is None else bias_new[:, :, None, :]  # [L,B,1,F]

        def ingest(cache: KVCache):
            """Depth 0: feed and commit the pending tokens; log-probs of the root's children."""
            pos = cache.length_b[:, None] + jnp.arange(a, dtype=jnp.int32)[None]
            mlp_bias = None
            if self.steered:  # drafted last round (under its g) before the root, the root under the new g
                new = jnp.arange(a)[None] >= (st.pending_count_b - 1)[:, None]
                mlp_bias = jnp.where(new[None, :, :, None], bias_new[:, :, None, :], st.steer_bias_lbf[:, :, None, :])
            out = forward(cfg, w, st.pending_tokens_ba, pos, cache=cache, mlp_bias_lbtf=mlp_bias)
            h_root = out.hidden_btd[rows, st.pending_count_b - 1][:, None]
            cache = commit(cache, out.k_new_lbthd, out.v_new_lbthd, st.pending_count_b * active.astype(jnp.int32))
            return jax.nn.log_softmax(logits(cfg, w, h_root, vocab), axis=-1), cache

        chain = self.plan.linear
        m = self.plan.n_scratch
        slot_depth: list = []  # depth of each scratch slot, in the order the tree drafters fill them

        def expand_fn(s, fr: tree_lib.Frontier):
            cache, tokens_bm, anc_bmm = s
            k = fr.tokens_bk.shape[1]
            slot_depth.extend([fr.depth] * k)
            if fr.depth == 0:
                logp, cache = ingest(cache)
                return logp, (cache, tokens_bm, anc_bmm)
            if chain:  # ancestors = cache slots p+2..p+k (written by the previous depths, uncommitted)
                slot_b = cache.length_b + fr.depth - 1  # this node's position p+1+depth
                out = forward(cfg, w, fr.tokens_bk, slot_b[:, None], cache=cache, cache_len_bt=slot_b,
                              mlp_bias_lbtf=round_bias)
                tmp = commit(KVCache(cache.k_lbhsd, cache.v_lbhsd, slot_b), out.k_new_lbthd, out.v_new_lbthd,
                             jnp.ones((b,), jnp.int32))
                cache = KVCache(tmp.k_lbhsd, tmp.v_lbhsd, cache.length_b)
                h = out.hidden_btd
            else:  # recompute every node expanded so far (slots 1..o+K; slot 0 = the root, cached)
                o = fr.slot_offset
                tokens_bm = jax.lax.dynamic_update_slice_in_dim(tokens_bm, fr.tokens_bk, o, axis=1)
                anc_bmm = jax.lax.dynamic_update_slice_in_dim(anc_bmm, fr.ancestor_bkn, o, axis=1)
                n = o + k
                depth_m = jnp.asarray(slot_depth[1:n], jnp.int32)
                pos = (cache.length_b - 1)[:, None] + depth_m[None]  # root at length-1 = p+1
                out = forward(cfg, w, tokens_bm[:, 1:n], pos, cache=cache, block_mask_btt=anc_bmm[:, 1:n, 1:n],
                              mlp_bias_lbtf=round_bias)
                h = out.hidden_btd[:, o - 1:n - 1]
            return jax.nn.log_softmax(logits(cfg, w, h, vocab), axis=-1), (cache, tokens_bm, anc_bmm)

        s0 = (st.draft_cache, jnp.zeros((b, m), jnp.int32), jnp.zeros((b, m, m), bool))
        tree, q, s = self.draft(expand_fn, s0, inp)
        new = st.replace(draft_cache=s[0])
        if self.steered:
            new = new.replace(steer_bias_lbf=jnp.where(active[None, :, None], bias_new, st.steer_bias_lbf))
        return full_proposal(tree, q, new)

    # ------------------------------------------------------------------ update

    def update(self, target, dp, st: DraftModelState, v: VerifiedPass) -> DraftModelState:
        """Pending = the emitted tokens (accepted drafts, then the bonus); SD²: g's source = h_cat
        at the last accepted node (the one whose logits gave the bonus)."""
        ver, active = v.verification, v.active_b
        new = st.replace(
            pending_tokens_ba=jnp.where(active[:, None], jnp.maximum(ver.emitted_bd, 0), st.pending_tokens_ba),
            pending_count_b=jnp.where(active, ver.n_accepted_b, st.pending_count_b))
        if self.steered:
            rows = jnp.arange(active.shape[0])
            src = v.target.h_cat_btc[rows, ver.last_node_b].astype(st.steer_src_bc.dtype)
            new = new.replace(steer_src_bc=jnp.where(active[:, None], src, st.steer_src_bc))
        return new


# ----------------------------------------------------------------------------- the families: plans and loading


def draft_model_weights(target_cfg: LlamaConfig, target_params: dict, source: Optional[str] = None, *,
                     steered: bool = False, target_tokenizer=None, target_source: str = "the loaded target"
                     ) -> LoadedDrafter:
    """What an independent draft model (family ``draft_model``) or SD² (family ``sd2``) decodes with
    (``decode.draft_model``; sources: ``runs.draft_models``): ``source`` = ``self:N`` (the target's first
    N layers; default a quarter of them), an asset / GGUF / Hugging Face directory sharing the target's
    tokenizer (checked against ``target_tokenizer``, default loaded from ``target_source``), or a
    trained ``launch.train`` SD² workdir: ``sd2`` decodes its fine-tuned drafter with its steering;
    ``draft_model`` decodes the fine-tuned drafter alone (the distilled baseline, a run with
    ``config.sd2.steer`` False, or a steered run's drafter without its steering, an ablation). SD²
    without a trained run gets the paper's initialisation (W_s = 0): it then drafts exactly as the
    unsteered model (``trained`` False)."""
    from confu_jax.models.early_exit import default_self_layers
    from confu_jax.models.steering import init_steering
    from confu_jax.runs import draft_models

    source = source or f"self:{default_self_layers(target_cfg)}"
    kw = dict(target_tokenizer=target_tokenizer, target_source=target_source)
    trained = True
    if draft_models.is_sd2_workdir(source):
        run = draft_models.load_sd2_run(source, target_cfg, target_params, **kw)
        if steered and run.steering is None:
            raise ValueError(f"{source} is a distilled run (config.sd2.steer=False): it has no steering to decode "
                             "--method sd2 with; decode its drafter with --method draft_model")
        d, steering = run.drafter, (run.steering if steered else None)
    else:
        d = draft_models.load_drafter(source, target_cfg, **kw)
        steering = None
        if steered:
            steering, trained = jax.device_get(init_steering(target_cfg.d_model, 3, d.cfg)), False
    draft = {} if d.params is None else {"model": d.params}
    if steering is not None:
        draft["steering"] = steering
    desc = d.source + ("" if not steered else " + SD² steering" + ("" if trained else " (untrained: W_s = 0)"))
    return own_weights(target_cfg, target_params, draft, trained, desc, draft_model=d.cfg)


def _draft_model_loader(steered: bool):
    """An independent draft model (``self:N``, a checkpoint, an SD² run), steered (SD²) or not."""

    def load(method, target_cfg, target_params, source, *, seed=0, step=None, target_source="the loaded target",
             target_tokenizer=None):
        del method, seed, step
        return draft_model_weights(target_cfg, target_params, source, steered=steered,
                                   target_tokenizer=target_tokenizer, target_source=target_source)

    return load


def _parse_draft_model(text: str) -> DraftModel:
    return DraftModel(parse_plan(text, what="a draft model"))


def _parse_sd2(text: str) -> DraftModel:
    return DraftModel(parse_plan(text, what="a draft model"), steered=True)


FAMILIES = (
    DrafterFamily("draft_model", _parse_draft_model, _draft_model_loader(False), source_flag="draft_model",
                  methods=(Method("draft_model", (), "an independent draft model sharing the target's tokenizer "
                                  "(self:N = the target's first N layers, or a GGUF / HF checkpoint), with its own "
                                  "KV cache"),)),
    DrafterFamily("sd2", _parse_sd2, _draft_model_loader(True), source_flag="draft_model",
                  methods=(Method("sd2", (), "SD²: a draft model steered by the target's hidden states (trained "
                                  "with configs/*_sd2.py)"),)),
)
