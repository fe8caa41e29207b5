"""Model-free prompt lookup (n-gram) drafting, inside the jitted loop (docs/DESIGN.md §11).

Text that copies from its context — summaries, answers quoting a passage, code edits, and a small
model's greedy text, which repeats itself — can be drafted for free: find an earlier place where
the last few tokens occurred and propose what followed them there (transformers'
``prompt_lookup_num_tokens``, vLLM's ``ngram`` proposer, SuffixDecoding). Here the match runs on
device over a per-row token history (prompt + everything emitted + the root), so drafting never
leaves the ``while_loop`` (JAX peers match on the host between jitted rounds).

**Matching** (``match_lengths``, ``lookup_continuations``): the text's suffix is the history up to
and including the root x[p+1]. For every earlier end position e < p+1, m[e] = the number of tokens
ending at e that equal the suffix's last tokens, capped at ``max_match``. Candidates are the e with
m[e] >= ``min_match``, ranked longest match first, then most recent first (a small model repeats
its recent sentences more often than distant ones). The continuation of e is x[e+1..e+k], cut at
the end of the history (a match near the end may overlap the suffix itself). ``branches`` W keeps
the best W candidates with pairwise distinct continuations.

**Tree** (``lookup_tree``): the W continuations as a trie under the root — a shared prefix is one
path, so sibling tokens are distinct (the sampled rule never tries the same token twice). Node of
branch w at depth i+1 has index 1 + w·k + i; nodes duplicated by an earlier branch are padding.
The draft distribution q is a point mass on each drafted token, so the deterministic-draft rules
(greedy, and the sequential residual rule at temperature > 0) stay exact.

**Width.** ``n_nodes_b`` is 1 where nothing matched, so with the default pass widths (1, T) an
iteration in which no active row found a match verifies the root alone: one AR step, not a
full-width pass (on a CPU a pass of 4 tokens costs ~1.5 AR steps).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from confu_jax.decode import tree as tree_lib
from confu_jax.decode.drafter import DraftInput, Drafter, PrefillView, Proposal, VerifiedPass
from confu_jax.decode.family import DrafterFamily, Method
from confu_jax.decode.loaded import LoadedDrafter, model_free

NO_TOKEN = -1  # history slots past the text, and continuation slots past the history


@flax.struct.dataclass(kw_only=True)
class LookupState:
    """The text a lookup drafter matches against, per row."""

    history_bn: jax.Array  # [B, S+1] int32 x[0..p+1]: prompt, emitted tokens, the root; NO_TOKEN after


def match_lengths(history_bn: jax.Array, length_b: jax.Array, max_match: int) -> jax.Array:
    """[B,N] int32: at each earlier end e < length-1, how many tokens ending at e equal the tokens
    ending at length-1 (the suffix), capped at ``max_match``; 0 at e >= length-1."""
    b, n = history_bn.shape
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    run = jnp.ones((b, n), bool)
    m = jnp.zeros((b, n), jnp.int32)
    for i in range(max_match):
        src = length_b - 1 - i
        suffix_b = jnp.take_along_axis(history_bn, jnp.maximum(src, 0)[:, None], axis=1)[:, 0]
        shifted = history_bn if i == 0 else jnp.concatenate(
            [jnp.full((b, i), NO_TOKEN, history_bn.dtype), history_bn[:, : n - i]], axis=1)  # x[e-i]
        run = run & (shifted == suffix_b[:, None]) & (shifted != NO_TOKEN) & (src >= 0)[:, None]
        m = m + run.astype(jnp.int32)
    return jnp.where(pos < (length_b - 1)[:, None], m, 0)


def continuations(history_bn: jax.Array, length_b: jax.Array, k: int) -> jax.Array:
    """[B,N,k] int32: x[e+1..e+k] for every end e, NO_TOKEN where it runs past length-1."""
    b, n = history_bn.shape
    idx = jnp.arange(n, dtype=jnp.int32)[:, None] + 1 + jnp.arange(k, dtype=jnp.int32)[None]  # [N,k]
    tok = jnp.take_along_axis(history_bn, jnp.minimum(idx, n - 1).reshape(1, -1).repeat(b, 0), axis=1)
    tok = tok.reshape(b, n, k)
    return jnp.where(idx[None] <= (length_b - 1)[:, None, None], tok, NO_TOKEN)


def lookup_continuations(history_bn: jax.Array, length_b: jax.Array, *, k: int, branches: int,
                         min_match: int, max_match: int):
    """The best ``branches`` distinct continuations of the suffix -> (tokens_bwk [B,W,k] int32,
    NO_TOKEN = none; match_bw [B,W] int32 their match lengths, 0 = no branch). Ranked by match
    length, then recency (the later end first)."""
    b, n = history_bn.shape
    rows = jnp.arange(b)
    m = match_lengths(history_bn, length_b, max_match)
    cont = continuations(history_bn, length_b, k)
    score = jnp.where(m >= min_match, m * n + jnp.arange(n, dtype=jnp.int32)[None], -1)
    tokens, match = [], []
    for _ in range(branches):
        best = jnp.argmax(score, axis=1)
        ok = jnp.max(score, axis=1) >= 0
        c = jnp.where(ok[:, None], cont[rows, best], NO_TOKEN)
        tokens.append(c)
        match.append(jnp.where(ok, m[rows, best], 0))
        score = jnp.where(jnp.all(cont == c[:, None, :], axis=-1), -1, score)  # drop equal continuations
    return jnp.stack(tokens, 1), jnp.stack(match, 1)


def lookup_tree(root_b: jax.Array, tokens_bwk: jax.Array):
    """The continuations as a trie under the root -> (DraftTree with T = 1 + W·k nodes, n_nodes_b
    [B] = 1 + the index of the last real node: the leading nodes worth verifying)."""
    b, w_n, k = tokens_bwk.shape
    # same_bwvi[b, w, v, i]: branches w and v agree on depths 1..i+1
    eq = tokens_bwk[:, :, None, :] == tokens_bwk[:, None, :, :]
    same = jnp.cumprod(eq.astype(jnp.int32), axis=-1).astype(bool)
    first_bwi = jnp.argmax(same, axis=2).astype(jnp.int32)  # the earliest branch with w's prefix (<= w)
    w_idx = jnp.arange(w_n, dtype=jnp.int32)[None, :, None]
    i_idx = jnp.arange(k, dtype=jnp.int32)[None, None, :]
    valid = (tokens_bwk != NO_TOKEN) & (first_bwi == w_idx)
    parent_first = jnp.concatenate([jnp.zeros((b, w_n, 1), jnp.int32), first_bwi[:, :, :-1]], axis=2)
    parents = jnp.where(i_idx == 0, 0, 1 + parent_first * k + i_idx - 1)
    node_tokens = jnp.concatenate([root_b[:, None], jnp.maximum(tokens_bwk, 0).reshape(b, -1)], axis=1)
    node_parents = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), parents.reshape(b, -1)], axis=1)
    node_valid = jnp.concatenate([jnp.ones((b, 1), bool), valid.reshape(b, -1)], axis=1)
    tree = tree_lib.build_tree(node_tokens, node_parents, k, node_valid)
    t = node_tokens.shape[1]
    n_nodes_b = jnp.max(jnp.where(tree.valid_bt, jnp.arange(t, dtype=jnp.int32)[None] + 1, 1), axis=1)
    return tree, n_nodes_b.astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class PromptLookup(Drafter):
    """Model-free n-gram drafting: ``k`` tokens per branch, ``branches`` distinct continuations,
    matches of ``min_match``..``max_match`` tokens; ``pass_widths`` the verification widths the
    loop compiles besides the full tree (default: 1, so an iteration without a match is an AR step)."""

    k: int = 3
    branches: int = 1
    min_match: int = 2
    max_match: int = 4
    pass_widths: tuple = (1,)

    def __post_init__(self):
        if self.k < 1 or self.branches < 1:
            raise ValueError(f"PromptLookup needs k >= 1 and branches >= 1, got k={self.k}, branches={self.branches}")
        if not 1 <= self.min_match <= self.max_match:
            raise ValueError(f"PromptLookup needs 1 <= min_match <= max_match, got {self.min_match}..{self.max_match}")
        bad = [w for w in self.pass_widths if not 1 <= int(w) <= self.n_nodes]
        if bad:
            raise ValueError(f"PromptLookup pass_widths must lie in [1, T={self.n_nodes}], got {bad}")

    @property
    def max_depth(self) -> int:
        return self.k

    @property
    def n_nodes(self) -> int:
        return 1 + self.branches * self.k

    @property
    def widths(self) -> tuple:
        return tuple(sorted({int(w) for w in self.pass_widths} | {self.n_nodes}))

    def init(self, target, dp, view: PrefillView) -> LookupState:
        b, width = view.tokens_bt.shape
        pos = jnp.arange(view.max_len + 1, dtype=jnp.int32)[None]
        prompt = jnp.concatenate([view.tokens_bt.astype(jnp.int32),
                                  jnp.full((b, view.max_len + 1 - width), NO_TOKEN, jnp.int32)], axis=1)
        hist = jnp.where(pos < view.lengths_b[:, None], prompt, NO_TOKEN)
        hist = jnp.where(pos == view.lengths_b[:, None], view.first_b[:, None].astype(jnp.int32), hist)
        return LookupState(history_bn=hist)

    def propose(self, target, dp, st: LookupState, inp: DraftInput) -> Proposal:
        tokens, _ = lookup_continuations(st.history_bn, inp.anchor_b + 2, k=self.k, branches=self.branches,
                                         min_match=self.min_match, max_match=self.max_match)
        tree, n_nodes_b = lookup_tree(inp.root_b, tokens)
        return Proposal(tree, None, n_nodes_b, None, st)

    def update(self, target, dp, st: LookupState, v: VerifiedPass) -> LookupState:
        """Append the emitted tokens (accepted drafts, then the bonus) after the old root x[p+1]."""
        ver = v.verification
        b, a = ver.emitted_bd.shape
        j = jnp.arange(a, dtype=jnp.int32)[None]
        cols = v.anchor_b[:, None] + 2 + j
        write = (j < ver.n_accepted_b[:, None]) & v.active_b[:, None]
        cols = jnp.where(write, cols, st.history_bn.shape[1])
        hist = st.history_bn.at[jnp.arange(b)[:, None], cols].set(ver.emitted_bd, mode="drop")
        return st.replace(history_bn=hist)

    def describe(self) -> str:
        return f"lookup:{self.k},{self.branches},{self.min_match},{self.max_match}"


# ----------------------------------------------------------------------------- the family: plans and loading

# prompt lookup: chains of 2..8 and tries of 2 / 4 continuations
LOOKUP_CHAINS = tuple(f"chain:{k}" for k in (2, 3, 4, 6, 8))
DEFAULT_LOOKUP_TREES = ("lookup:4,2", "lookup:6,2", "lookup:4,4")
LOOKUP_FORMS = "chain:K or lookup:K[,W[,NMIN,NMAX]] (e.g. chain:3, lookup:4,2, lookup:4,1,3,5)"


def parse_lookup(text: str) -> PromptLookup:
    kind, _, arg = text.partition(":")
    try:
        vals = [int(x) for x in arg.split(",")] if arg else []
        if kind == "chain" and len(vals) == 1:
            return PromptLookup(k=vals[0])
        if kind == "lookup" and len(vals) in (1, 2, 4):
            k, w = vals[0], (vals[1] if len(vals) > 1 else 1)
            if len(vals) == 4:
                return PromptLookup(k=k, branches=w, min_match=vals[2], max_match=vals[3])
            return PromptLookup(k=k, branches=w)
    except ValueError as e:
        raise ValueError(f"bad lookup plan {text!r}: {e}. Expected {LOOKUP_FORMS}") from None
    raise ValueError(f"bad lookup plan {text!r}: expected {LOOKUP_FORMS}")


def load_model_free(method, target_cfg, target_params, source, **kw) -> LoadedDrafter:
    """A model-free family's ``DrafterFamily.load``: the target alone; a source is refused."""
    del kw
    if source:
        raise ValueError(f"method {method.name!r} is model-free: it takes no head (got {source})")
    return model_free(target_cfg, target_params)


FAMILIES = (DrafterFamily(
    "lookup", parse_lookup, load_model_free,
    methods=(Method("lookup", (), "model-free prompt lookup: n-gram matches in the prompt and the generated text"),),
    chains=LOOKUP_CHAINS, trees=DEFAULT_LOOKUP_TREES),)
