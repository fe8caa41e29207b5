"""DFlash as a ``Drafter`` (docs/DESIGN.md §11 "DFlash"; the model: ``models.dflash``; reference:
z-lab/dflash ``dflash/model.py`` ``dflash_generate`` at commit 44947fbf71114e241c96de194f4b382b5dd330d0).

Why it is its own family: one draft forward proposes the **whole block**. The reference's loop, in
this project's terms (p = the last accepted position, x[p+1] = the bonus / root):

* the draft's KV cache holds, per draft layer, the K/V of the target's fused features c[j] for the
  committed positions j = 0..p (``past_key_values_draft`` cropped to ``start`` after every block: the
  block's own K/V are dropped);
* propose: the block [x[p+1], M, ..., M] (K masks) at positions p+1..p+K+1, bidirectional inside,
  attending the whole cache; position k >= 1's logits (target LM head) are the draft for x[p+1+k];
* update: the target's taps of the accepted nodes (``VerifyOutput.h_cat_btc`` along the accepted
  path: positions p+1..p+a) become new context entries (``extract_context_feature(...)[:, :a]``).

``init`` commits the prompt's taps (``PrefillView.h_cat_btc``, positions 0..n-1). The cache therefore
always has length p+1 when a block is drafted.

**Drafts and q.** Every block position's distribution is computed in the one forward from the root
and masks only: it does not depend on the other drafted tokens. So

* ``chain:K`` is the per-position argmax — what the reference drafts at every temperature
  (``sample(draft_logits)`` with its default temperature 0); verified by the greedy rule at T = 0 and
  by the deterministic-draft (point-mass q) rule at T > 0, which accepts a draft with the target's
  probability of it, as the reference's "accept iff the target's sample equals the draft" does;
* ``sampled_chain:K`` (ours; T > 0) draws position k from q_k = its softmax after the target's
  temperature / top-p, independently, and Leviathan's rule uses exactly that q_k (the q a drafted
  token was drawn from; conditioning on the earlier drafts changes nothing);
* ``tree:k1,...,kD`` (ours) is the Cartesian tree of per-position top-k (Medusa's shape, since like
  Medusa's heads the positions do not see each other's tokens), ``dynamic:D,K,N`` EAGLE-2's
  selection over it, and ``ddtree:N[,D]`` DDTree's (arXiv 2604.12989): the N best nodes of that tree
  by path log-probability, found best-first (``decode.tree.draft_block_tree``), verified in the one
  tree pass under the greedy rule at T = 0 and the sequential-residual rule at T > 0 (its tokens are
  a deterministic function of the block: point-mass q, exactly as ``tree:``).

The block always has D+1 tokens for a depth-D plan (the reference's ``block_size`` argument of
``dflash_generate``; its published drafters are trained with 16). Verification is the project's
exact rules (§4).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from confu_jax.decode.drafter import DraftInput, PlanDrafter, PrefillView, Proposal, VerifiedPass, full_proposal
from confu_jax.decode.family import (DEFAULT_CARTESIAN_TREES, DrafterFamily, Method, SourceKind, own_weights_loader,
                                     resolve_source)
from confu_jax.decode.loaded import LoadedDrafter, own_weights
from confu_jax.runs import dflash as runs_dflash
from confu_jax.decode.plans import DraftPlan, FanoutTree, parse_plan
from confu_jax.models.dflash import (block_hidden, block_logits, block_self_mask, check_dflash_params,
                                     context_features, context_kv, embed_block, model_params)
from confu_jax.models.kv_cache import KVCache, commit, init_cache
from confu_jax.models.vocab_map import to_target_vocab

DFLASH_FORMS = ("chain:K (a block of K+1: the root and K masks), sampled_chain:K, dynamic:D,K,N, tree:k1,...,kD "
                "(top-k_i of block position i), ddtree:N[,D] (DDTree: the N best nodes over the block's "
                "per-position top-k, at most D deep) or accum_logp:N,W[,D] (JetSpec's tree: the best node's W "
                "children at a time, N nodes)")


@flax.struct.dataclass(kw_only=True)
class DFlashState:
    draft_cache: KVCache  # [L_d, B, Hkv_d, S, hd_d]: the context K/V of positions 0..p (length p+1)


def dflash_params(dp, key: str = "dflash") -> dict:
    """``dp.weights[key]``: a DFlash tree (``key`` 'dflash') or one built on it (DSpark's, 'dspark')."""
    p = (dp.weights or {}).get(key)
    if p is None:
        raise ValueError(f"a {key} drafter needs drafter_params.weights[{key!r}] (its init, a trained configs/*_{key}.py "
                         f"workdir, or an imported directory: decode.families.decode_head)")
    if "mask_token_id" not in p:
        raise ValueError(f"drafter_params.weights[{key!r}] needs 'mask_token_id' (the block's mask token)")
    return p


def draft_spec(dp):
    """The draft's LlamaConfig (``DrafterParams.draft_model``; ``load_dflash`` sets it)."""
    if dp.draft_model is None:
        raise ValueError("a DFlash drafter needs DrafterParams.draft_model (the draft's layer config; "
                         "decode.families.decode_head('dflash', ...) sets it)")
    return dp.draft_model


def parse_conditional_plan(text: str, what: str, forms: str) -> DraftPlan:
    """A block plan for a drafter whose children follow their parent's token (DSpark, DFlash2, Domino): every
    block plan but ``accum_logp``, which offers every parent the same children."""
    plan = parse_plan(text, what=what, forms=forms, block=True)
    if isinstance(plan, FanoutTree):
        raise ValueError(f"bad {what} plan {text!r}: accum_logp offers every parent the same top-W, but {what} "
                         f"drafts each node's children from that node; expected {forms}")
    return plan


def parse_dflash_plan(text: str) -> DraftPlan:
    """``chain:K``, ``sampled_chain:K``, ``dynamic:D,K,N``, ``tree:k1,...,kD``, ``ddtree:N[,D]`` or
    ``accum_logp:N,W[,D]`` (no ``+cM``)."""
    return parse_plan(text, what="DFlash", forms=DFLASH_FORMS, block=True)


def context_entries(dp, p: dict, taps_btc, positions_bt):
    """Every draft layer's K/V of the target taps ``taps_btc`` at ``positions_bt`` ([L_d,B,T,Hkv,hd])."""
    dcfg = draft_spec(dp)
    return context_kv(p, dcfg, context_features(p, dcfg, taps_btc), positions_bt)


@dataclasses.dataclass(frozen=True)
class DFlashDrafter(PlanDrafter):
    """A DFlash draft drafting the trees of ``plan`` from one block forward (module docstring)."""

    plan: DraftPlan
    what = "a DFlash draft"
    params_key = "dflash"  # where its tree lives in DrafterParams.weights (a subclass built on the backbone: its own)
    causal = False  # the block attends bidirectionally (JetSpec's causal head: decode.jetspec)

    def backbone(self, p: dict) -> dict:
        """The DFlash float tree of this drafter's tree (``models.dflash.model_params``)."""
        return model_params(p)

    def conv(self, p: dict):
        """The (K, group size) of the convolutions this drafter's layers hold (DFlash2's), or None."""
        return None

    def init(self, target, dp, view: PrefillView) -> DFlashState:
        p = dflash_params(dp, self.params_key)
        dcfg = draft_spec(dp)
        check_dflash_params(self.backbone(p), dcfg, len(dp.spec(target.config).taps), self.conv(p))
        b, w = view.tokens_bt.shape
        cache = init_cache(dcfg.n_layers, b, view.max_len, dcfg.n_kv_heads, dcfg.head_dim, jnp.dtype(dcfg.dtype))
        k, v = context_entries(dp, p, view.h_cat_btc, jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w)))
        return DFlashState(draft_cache=commit(cache, k, v, view.lengths_b))

    def block_states(self, target, dp, st: DFlashState, inp: DraftInput, slots: int) -> jax.Array:
        """The block [x[p+1], M, ..., M] of ``slots`` at positions p+1.. against the draft's cache -> its
        final-normed states [B, slots, d] (every block family's one forward; DFlash2's convolutions inside it)."""
        p = dflash_params(dp, self.params_key)
        b = inp.root_b.shape[0]
        blk = jnp.full((b, slots), p["mask_token_id"], jnp.int32).at[:, 0].set(inp.root_b)
        pos = inp.anchor_b[:, None] + 1 + jnp.arange(slots, dtype=jnp.int32)[None]
        cache = st.draft_cache
        return block_hidden(self.backbone(p), draft_spec(dp), embed_block(target.params, blk), pos,
                            block_self_mask(b, slots, self.causal), cache.k_lbhsd, cache.v_lbhsd, cache.length_b,
                            block_len=slots)

    def propose(self, target, dp, st: DFlashState, inp: DraftInput) -> Proposal:
        h = self.block_states(target, dp, st, inp, self.max_depth + 1)
        logits = to_target_vocab(block_logits(target.config, target.params, h[:, 1:]), target.config.vocab_size)
        tree, q = self.draft_positional(jax.nn.log_softmax(logits, axis=-1), inp)
        return full_proposal(tree, q, st)

    def update(self, target, dp, st: DFlashState, v: VerifiedPass) -> DFlashState:
        """The accepted nodes' taps (positions p+1..p+a) join the context; inactive rows commit nothing."""
        p = dflash_params(dp, self.params_key)
        ver = v.verification
        path = jnp.maximum(ver.path_bd, 0)
        taps = jnp.take_along_axis(v.target.h_cat_btc, path[..., None], axis=1)
        pos = v.anchor_b[:, None] + 1 + jnp.arange(path.shape[1], dtype=jnp.int32)[None]
        k, vv = context_entries(dp, p, taps, pos)
        n_new = jnp.where(v.active_b, ver.n_accepted_b, 0)
        return st.replace(draft_cache=commit(st.draft_cache, k, vv, n_new))


# ----------------------------------------------------------------------------- the family: loading


def load_dflash(target_cfg, target_params: dict, source=None, seed: int = 0,
                target_source: str = "the loaded target", num_layers: int = 3, causal: bool = False) -> LoadedDrafter:
    """What DFlash decodes with: the draft of a ``launch.train`` DFlash workdir (``runs.dflash``, target
    checked), of a published z-lab DFlash directory (config.json with ``DFlashDraftModel`` /
    ``dflash_config`` + model.safetensors: ``weights.dflash_format``; its width must be the target's and
    it must read 3 target layers, this project's tap count), or, with no source, an untrained draft
    (``num_layers`` layers of the target's shape over the reference's default layers, the last token id
    as the mask; ``trained`` False). A trained draft keeps its block size (``block_depth``: plans
    deeper than the block are refused). The drafter params carry the draft's layer config (``DrafterParams.draft_model``)
    and its taps. ``causal``: load a JetSpec head instead (``decode.jetspec``: a run or directory with
    ``causal_head``, kept under ``weights['jetspec']``); each refuses the other's, naming the method."""
    import numpy as np

    name, key = ("JetSpec", "jetspec") if causal else ("DFlash", "dflash")

    def same_kind(found: bool, where: str) -> None:
        if found != causal:
            other = "jetspec" if found else "dflash"
            raise ValueError(f"{source}: {where} is a {'JetSpec (causal_head)' if found else 'DFlash (bidirectional)'} "
                             f"draft; decode it with --method {other}")

    from confu_jax.models.dflash import default_taps, draft_config, init_dflash
    from confu_jax.runs.dflash import is_dflash_workdir, load_dflash_run
    from confu_jax.weights.dflash_format import is_dflash_dir, load_dflash_dir

    def run(path):
        r = load_dflash_run(path, target_cfg, target_params, target_source=target_source)
        same_kind(r.causal_head, "the run")
        return r.params, r.draft, r.taps, r.mask_token_id, r.block_size, r.source

    def published(path):
        imp = load_dflash_dir(path)
        same_kind(imp.causal_head, "the directory")
        if imp.draft.d_model != target_cfg.d_model:
            raise ValueError(f"{source}: a DFlash draft of width {imp.draft.d_model} cannot read a target of width "
                             f"{target_cfg.d_model} (its block input is the target's embedding)")
        if imp.num_target_layers and imp.num_target_layers != target_cfg.n_layers:
            raise ValueError(f"{source}: a DFlash draft for a {imp.num_target_layers}-layer target; the target has "
                             f"{target_cfg.n_layers}")
        if not imp.taps or max(imp.taps) >= target_cfg.n_layers:
            raise ValueError(f"{source}: target_layer_ids {[t - 1 for t in imp.taps]}: expected outputs of layers "
                             f"below the last ({target_cfg.n_layers - 1}) of this {target_cfg.n_layers}-layer target")
        dcfg = imp.draft.replace(vocab_size=target_cfg.vocab_size, dtype=target_cfg.dtype,
                                 param_dtype=target_cfg.param_dtype)
        return (imp.params, dcfg, imp.taps, imp.mask_token_id, imp.block_size,
                f"{path} ({'JetSpec' if causal else 'z-lab DFlash'} format, block {imp.block_size})")

    if source is None:
        dcfg, taps = draft_config(target_cfg, num_layers), default_taps(target_cfg.n_layers)
        params = jax.device_get(init_dflash(jax.random.PRNGKey(seed), dcfg, len(taps)))
        mask, block, trained = target_cfg.vocab_size - 1, None, False
        desc = f"{name} initialisation ({num_layers} layers, seed {seed})"
    else:
        params, dcfg, taps, mask, block, desc = resolve_source(source, (
            SourceKind(f"a {name} launch.train workdir (config.json with a 'dflash' section + checkpoints/)",
                       is_dflash_workdir, run),
            SourceKind(f"a published {name} directory (config.json with architectures ['DFlashDraftModel'] + "
                       "model.safetensors)", is_dflash_dir, published)))
        trained = True
    check_dflash_params(params, dcfg, len(taps))
    scalars = {"mask_token_id": np.int32(mask), **({} if block is None else {"block_size": np.int32(block)})}
    return own_weights(target_cfg, target_params, {key: {**params, **scalars}}, trained,
                       desc, draft_model=dcfg, tap_layers=tuple(taps))


def published_block_config(source, imp, target_cfg, name: str, zlab_layer_ids: bool = False):
    """A published block draft's layer config on this target (DSpark's, DFlash2's, Domino's directories),
    after the checks every such layout needs: the draft's width and vocabulary are the target's (its block
    input is the target's embedding) and its taps are states of this target's layers. ``zlab_layer_ids``: the
    layout names them z-lab's way (``target_layer_ids``, layer outputs: tap − 1), else speculators'
    (``aux_hidden_state_layer_ids``, states entering a layer)."""
    if imp.draft.d_model != target_cfg.d_model or imp.draft.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"{source}: a {name} draft of width {imp.draft.d_model} over {imp.draft.vocab_size} "
                         f"tokens cannot read a target of width {target_cfg.d_model} over "
                         f"{target_cfg.vocab_size} (its block input is the target's embedding)")
    if max(imp.taps) >= target_cfg.n_layers:
        if zlab_layer_ids:
            raise ValueError(f"{source}: target_layer_ids {[t - 1 for t in imp.taps]}: expected outputs of layers "
                             f"below the last ({target_cfg.n_layers - 1}) of this {target_cfg.n_layers}-layer target")
        raise ValueError(f"{source}: aux_hidden_state_layer_ids {list(imp.taps)}: expected states entering "
                         f"layers of this {target_cfg.n_layers}-layer target (below {target_cfg.n_layers})")
    return imp.draft.replace(dtype=target_cfg.dtype, param_dtype=target_cfg.param_dtype)


def block_depth(dp, key: str = "dflash"):
    """The deepest plan a loaded DFlash (or JetSpec, ``key``) draft runs: its trained block holds the root and
    block_size - 1 masks (None for an initialisation, which was trained on nothing)."""
    block = dp.weights[key].get("block_size")
    return None if block is None else int(block) - 1


FAMILIES = (DrafterFamily(
    "dflash", lambda text: DFlashDrafter(parse_dflash_plan(text)), own_weights_loader(load_dflash),
    methods=(Method("dflash", (), "DFlash: a block-diffusion draft drafting a whole block in one forward, "
                    "conditioned on the target's taps as extra K/V (trained with configs/*_dflash.py, or a z-lab "
                    "DFlash directory)", own_weights=True),),
    trees=DEFAULT_CARTESIAN_TREES + ("ddtree:8,3",), max_depth=block_depth,
    export_formats=(runs_dflash.EXPORT_FORMAT,)),)
