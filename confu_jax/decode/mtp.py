"""DeepSeek-V3's MTP module as a ``Drafter`` (docs/DESIGN.md §11 "MTP module"; the module:
``models.mtp``; references: vLLM ``vllm/model_executor/models/deepseek_mtp.py`` with its
speculative proposer, SGLang ``python/sglang/srt/models/deepseek_nextn.py``).

Why it is its own family: the module is one transformer layer with **its own KV cache**, like the
EAGLE-3 head — so it drafts through the same machinery (``decode.drafting``: an ingestion buffer
committed at depth 0, tree levels attending the cache, their ancestors' K/V in a scratch buffer and
themselves; ``models.draft_decode.attend_blocks``) — but its input is the target's final-normed
hidden state h[j] (what the target's LM head reads, ``VerifyOutput.hidden_btd``) instead of
EAGLE-3's fc of three taps, and its embedding and LM head are the target's.

**Entries.** Cache slot j holds the layer's K/V of the entry (token x[j+1], hidden h[j]) at RoPE
position j: exactly what DeepSeek-V3's depth-1 module computes at position j. ``init`` commits the
prompt's entries j = 0..n-2 (``PrefillView.hidden_btd``) and buffers entry n-1 (the first emitted
token, h[n-1]); ``update`` refills the buffer with the accepted path (emitted tokens, the nodes'
hidden states); ``propose`` commits the buffer (depth 0) — its output at the anchor p is the
depth-1 draft — and grows the tree.

**Recursion.** A node at depth k ≥ 1 feeds (its own token, its parent's output h') at position p+k:
the module reused for every depth on its own output, as vLLM and SGLang run a one-layer
(``num_nextn_predict_layers = 1``) MTP for several speculative tokens. Deeper entries live only in
the per-iteration scratch; accepted tokens are re-fed next round from the target's hidden states.

**Trees** (``plan``): ``chain:K`` (each depth's top-1: vLLM's and SGLang's proposals),
``sampled_chain:K`` (q = each depth's distribution after the target's temperature / top-p,
Leviathan's rule), ``tree:k1,...,kD`` (every depth-d node's own top-k_{d+1}: the children differ
per parent, as for the MLP speculator), ``dynamic:D,K,N`` (EAGLE-2's selection) and any static
"choices" tree. Verification is the project's exact rules (§4).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp

from confu_jax.decode.drafter import DraftInput, PlanDrafter, PrefillView, Proposal, VerifiedPass, full_proposal
from confu_jax.decode.drafting import commit_prompt, draft_cached_tree, prompt_buffer, refill_entries
from confu_jax.decode.family import DrafterFamily, Method, SourceKind, own_weights_loader
from confu_jax.decode.hidden_state import load_own_tree, own_tree
from confu_jax.decode.loaded import LoadedDrafter
from confu_jax.runs import mtp as runs_mtp
from confu_jax.decode.plans import DraftPlan, parse_plan
from confu_jax.models.draft_decode import DraftBlockOutput
from confu_jax.models.kv_cache import KVCache, init_cache
from confu_jax.models.mtp import check_mtp_params, mtp_block
from confu_jax.models.vocab_map import to_target_vocab

MTP_FORMS = "chain:K, sampled_chain:K, dynamic:D,K,N or tree:k1,...,kD (top-k_i of depth i under every node)"


@flax.struct.dataclass(kw_only=True)
class MTPState:
    """What the MTP module keeps between iterations: its cache (entries 0..p-n) and the n pending
    entries j = p-n+1..p (n = ``ingest_count_b`` <= A = D+1) the last verification produced."""

    draft_cache: KVCache  # [1, B, Hkv, S, hd], length p-n+1
    ingest_tokens_ba: jax.Array  # [B, A] int32 token x[j+1] of the pending entries
    ingest_hidden_bad: jax.Array  # [B, A, d] the target's final-normed hidden state h[j]
    ingest_count_b: jax.Array  # [B] int32 pending entries (>= 1)


def mtp_params(dp) -> dict:
    return own_tree(dp, "mtp", "an MTP drafter", "models.mtp.init_mtp, a trained configs/*_mtp.py workdir, or an "
                    "imported DeepSeek-layout MTP directory")


def parse_mtp_plan(text: str) -> DraftPlan:
    """``chain:K``, ``sampled_chain:K``, ``dynamic:D,K,N`` or ``tree:k1,...,kD`` (no ``+cM``)."""
    return parse_plan(text, what="MTP module", forms=MTP_FORMS)


def _block(target, dp, mtp: dict, tokens_bt, hidden_btd, positions_bt, **kw) -> DraftBlockOutput:
    out = mtp_block(mtp, target.config, target.params, tokens_bt, hidden_btd, positions_bt, **kw)
    return out._replace(logits_btv=to_target_vocab(out.logits_btv, target.config.vocab_size))


@dataclasses.dataclass(frozen=True)
class MTPDrafter(PlanDrafter):
    """DeepSeek-V3's MTP module drafting the trees of ``plan`` (module docstring)."""

    plan: DraftPlan
    what = "an MTP module"

    def block_fn(self, target, dp):
        m = mtp_params(dp)
        check_mtp_params(m, target.config)
        return functools.partial(_block, target, dp, m)

    def init(self, target, dp, view: PrefillView) -> MTPState:
        if view.hidden_btd is None:
            raise ValueError("MTPDrafter.init needs PrefillView.hidden_btd (the target's hidden states of the prompt)")
        t = target.config
        b = view.tokens_bt.shape[0]
        cache = init_cache(1, b, view.max_len, t.n_kv_heads, t.head_dim, jnp.dtype(t.dtype))
        cache = commit_prompt(self.block_fn(target, dp), cache, view, view.hidden_btd)
        tokens, hidden, count = prompt_buffer(view, view.hidden_btd, self.max_depth + 1)
        return MTPState(draft_cache=cache, ingest_tokens_ba=tokens, ingest_hidden_bad=hidden, ingest_count_b=count)

    def propose(self, target, dp, st: MTPState, inp: DraftInput) -> Proposal:
        t = target.config
        tree, q, _, cache = draft_cached_tree(self.plan, self.block_fn(target, dp), st.draft_cache,
                                              st.ingest_tokens_ba, st.ingest_hidden_bad, st.ingest_count_b, inp,
                                              n_kv_heads=t.n_kv_heads, head_dim=t.head_dim, d_model=t.d_model,
                                              dtype=t.dtype)
        return full_proposal(tree, q, st.replace(draft_cache=cache))

    def update(self, target, dp, st: MTPState, v: VerifiedPass) -> MTPState:
        """The buffer <- the accepted path: emitted tokens and the nodes' final-normed hidden states."""
        if v.target.hidden_btd is None:
            raise ValueError("MTPDrafter.update needs VerifyOutput.hidden_btd (models.target.verify)")
        tokens, hidden, count = refill_entries(v, v.target.hidden_btd, st.ingest_tokens_ba, st.ingest_hidden_bad,
                                               st.ingest_count_b)
        return st.replace(ingest_tokens_ba=tokens, ingest_hidden_bad=hidden, ingest_count_b=count)


# ----------------------------------------------------------------------------- the family: loading

_LAYER_FIELDS = ("d_model", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "rope_theta", "rope_scaling", "rms_eps")


def load_mtp(target_cfg, target_params: dict, source=None, seed: int = 0,
             target_source: str = "the loaded target") -> LoadedDrafter:
    """What the MTP module decodes with: the module of a ``launch.train`` MTP workdir (``runs.mtp``, target
    checked), of a DeepSeek-layout directory (config.json with ``num_nextn_predict_layers`` +
    model.safetensors: ``weights.mtp_format``; its layer must be the target's layer shape, and any
    embedding / LM head copy the target's), or, with no source, the untrained module
    (``models.mtp.init_mtp``: the target's last layer, ``trained`` False)."""
    from confu_jax.models.mtp import init_mtp
    from confu_jax.runs.mtp import is_mtp_workdir, load_mtp_run
    from confu_jax.weights.mtp_format import check_shared, is_mtp_dir, load_mtp_dir

    def untrained():
        params = jax.device_get(init_mtp(jax.random.PRNGKey(seed), target_cfg, target_params))
        return params, f"MTP module initialisation (the target's last layer, seed {seed})"

    def run(path):
        r = load_mtp_run(path, target_cfg, target_params, target_source=target_source)
        return r.params, r.source

    def published(path):
        imp = load_mtp_dir(path)
        for field in _LAYER_FIELDS:
            if getattr(imp.block, field) != getattr(target_cfg, field):
                raise ValueError(f"{source}: an MTP layer with {field}={getattr(imp.block, field)} cannot run "
                                 f"as a layer of the target ({field}={getattr(target_cfg, field)})")
        check_shared(imp, target_cfg, target_params)
        return imp.params, f"{path} (DeepSeek-layout MTP, layer {imp.layer_index})"

    kinds = (SourceKind("an MTP launch.train workdir (config.json with an 'mtp' section + checkpoints/)",
                        is_mtp_workdir, run),
             SourceKind("a DeepSeek-layout MTP directory (config.json with num_nextn_predict_layers + "
                        "model.safetensors)", is_mtp_dir, published))
    return load_own_tree(target_cfg, target_params, "mtp", source, untrained=untrained, kinds=kinds,
                         check=lambda params: check_mtp_params(params, target_cfg), check_untrained=True)

FAMILIES = (DrafterFamily(
    "mtp", lambda text: MTPDrafter(parse_mtp_plan(text)), own_weights_loader(load_mtp),
    methods=(Method("mtp", (), "DeepSeek-V3's MTP module: one Llama layer on the target's last hidden state and the "
                    "next token, the target's embedding and LM head, drafting recursively (trained with "
                    "configs/*_mtp.py, or a DeepSeek-layout MTP directory)", own_weights=True),),
    export_formats=(runs_mtp.EXPORT_FORMAT,)),)
