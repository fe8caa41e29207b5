"""Draft plans: how the draft proposes tokens each iteration, and the text form users type.

A plan is a hashable static argument of the speculative program: changing it recompiles.
``parse_plan`` reads the CLI/config form (``chain:4``, ``dynamic:6,8,30``); ``verification_rule``
picks the lossless acceptance rule a plan needs at a temperature (docs/DESIGN.md §5).
"""

from __future__ import annotations

import dataclasses

from confu_jax.decode import tree as tree_lib

PLAN_FORMS = ("chain:K, sampled_chain:K or dynamic:DEPTH,TOPK,NODES, optionally +cM for ConFu's sparse "
              "contemplates (e.g. chain:4, dynamic:6,8,30, dynamic:6,10,60+c15)")


@dataclasses.dataclass(frozen=True)
class DraftPlan:
    """How the draft proposes tokens each iteration (hashable: a static jit argument).

    kinds: ``chain`` (k greedy tokens), ``sampled_chain`` (k tokens sampled from the draft; the
    Leviathan rule at temperature > 0), ``static`` (EAGLE/Medusa "choices" paths filled with the
    draft's top-k), ``dynamic`` (EAGLE-2: depth, top_k per expansion, n_nodes including the root).

    ``contemplates`` (ConFu; 0 = after every node): sparse contemplates — only M of the T nodes get a
    contemplate token in the verification pass (T + M queries instead of 2T): the M nodes the draft
    scores highest (cumulative draft log-probability; for chains and static trees, whose nodes are
    in that order already, the first M), the root always among them. The next iteration's future
    vector comes from the deepest contemplated node on the accepted path (docs/DESIGN.md §4).
    EAGLE-3 heads ignore it.
    """

    kind: str
    k: int = 0
    depth: int = 0
    top_k: int = 0
    n_nodes: int = 0
    paths: tuple = ()
    contemplates: int = 0

    def __post_init__(self):
        if self.kind in ("chain", "sampled_chain"):
            if self.k < 1:
                raise ValueError(f"{self.kind} needs k >= 1, got {self.k}")
        elif self.kind == "dynamic":
            if self.depth < 1 or self.top_k < 1 or self.n_nodes < 2:
                raise ValueError(f"dynamic tree needs depth>=1, top_k>=1, n_nodes>=2; got {self}")
        elif self.kind == "static":
            if not self.paths:
                raise ValueError("static tree needs a non-empty list of paths")
        else:
            raise ValueError(f"unknown draft plan kind {self.kind!r}; expected chain, sampled_chain, "
                             "static or dynamic")
        if not 0 <= self.contemplates <= self.n_nodes_total:
            raise ValueError(f"contemplates must be in [1, T={self.n_nodes_total}] (or 0: after every node); "
                             f"got {self.contemplates}")

    @property
    def n_contemplates(self) -> int:
        """M: contemplate tokens per verification (ConFu); T unless the plan makes them sparse."""
        return self.contemplates or self.n_nodes_total

    @property
    def max_depth(self) -> int:
        if self.kind in ("chain", "sampled_chain"):
            return self.k
        if self.kind == "dynamic":
            return self.depth
        return max(len(p) for p in self.paths)

    def structure(self) -> tree_lib.StaticStructure:
        """The fixed tree shape of a chain, sampled chain or static plan (not of a dynamic one)."""
        if self.kind == "dynamic":
            raise ValueError("a dynamic plan has no fixed structure")
        if self.kind == "static":
            return tree_lib.static_structure(self.paths)
        return tree_lib.chain_structure(self.k)

    @property
    def n_nodes_total(self) -> int:
        """T: tree nodes per verification, root included."""
        if self.kind == "dynamic":
            return self.n_nodes
        return self.structure().n_nodes

    @property
    def text(self) -> str:
        """The form ``parse_plan`` reads (static trees, which have no text form, show their paths)."""
        if self.kind in ("chain", "sampled_chain"):
            body = f"{self.kind}:{self.k}"
        elif self.kind == "dynamic":
            body = f"dynamic:{self.depth},{self.top_k},{self.n_nodes - 1}"
        else:
            body = f"static:{list(self.paths)}"
        return body + (f"+c{self.contemplates}" if self.contemplates else "")

    @property
    def n_scratch(self) -> int:
        """Draft scratch slots one iteration uses (the K/V of the expanded tree nodes)."""
        if self.kind == "dynamic":
            return tree_lib.dynamic_scratch_size(self.depth, self.top_k)
        return tree_lib.scratch_slots(self.structure())


def parse_plan(text: str) -> DraftPlan:
    """``chain:K`` | ``sampled_chain:K`` | ``dynamic:DEPTH,TOPK,NODES`` (NODES excludes the root,
    as EAGLE-2's total_tokens), each optionally followed by ``+cM`` (M sparse contemplates)
    -> DraftPlan. Errors say which form was expected."""
    body, plus, con = text.partition("+")
    kind, _, arg = body.partition(":")
    try:
        m = 0
        if plus:
            if not con.startswith("c"):
                raise ValueError(f"the suffix {'+' + con!r} is not +cM")
            m = int(con[1:])
            if m < 1:
                raise ValueError(f"+cM needs M >= 1, got {m}")
        if kind in ("chain", "sampled_chain"):
            return DraftPlan(kind, k=int(arg), contemplates=m)
        if kind == "dynamic":
            d, k, t = (int(x) for x in arg.split(","))
            return DraftPlan("dynamic", depth=d, top_k=k, n_nodes=t + 1, contemplates=m)
    except ValueError as e:
        raise ValueError(f"bad draft plan {text!r}: {e}. Expected {PLAN_FORMS}") from None
    raise ValueError(f"bad draft plan {text!r}: expected {PLAN_FORMS}")


VERIFICATION_RULES = ("greedy", "sampled_tree", "sampled_chain")


def verification_rule(plan: DraftPlan, greedy: bool) -> str:
    """greedy at temperature 0; the Leviathan rule for sampled chains; else sequential residuals."""
    if greedy:
        return "greedy"
    return "sampled_chain" if plan.kind == "sampled_chain" else "sampled_tree"
