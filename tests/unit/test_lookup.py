"""Prompt lookup and hybrid drafting (``decode.lookup``, ``decode.hybrid``).

(1) The n-gram matcher equals a pure-Python reference on random token streams (longest match,
ties to the most recent, continuations running into the end of the text, distinct branches,
an empty history); (2) the trie the loop verifies holds exactly the distinct continuations;
(3) in the loop, greedy output equals AR token for token (chain, tree, hybrid with EAGLE-3 and
ConFu heads, batch of 2 with different prompt lengths, EOS inside a draft), sampled output
passes the chi-square test against the exact joint of the target (a sharded run:
tests/contract/test_family_contract.py); (4) the per-iteration pass width: an iteration without a match verifies the
root alone.
"""

import random

import jax.numpy as jnp
import numpy as np
import pytest

from confu_jax.decode import families, loop, lookup, plans
from confu_jax.decode.drafting import HeadDrafter
from confu_jax.decode.generate import generate_ar
from confu_jax.decode.hybrid import Hybrid
from confu_jax.decode.lookup import NO_TOKEN, PromptLookup
from tests.helpers.family_checks import assert_sampling_is_lossless
from tests.helpers.jitting import jit_static
from tests.helpers.loop_fixtures import generated_rows, make, own

# the matcher and the trie under jit (tests/helpers/jitting.py: called eagerly, every primitive compiles on its own)
lookup_continuations, lookup_tree = jit_static(lookup.lookup_continuations), jit_static(lookup.lookup_tree)


# ----------------------------------------------------------------------------- reference matcher


def reference_lookup(text, *, k, branches, min_match, max_match):
    """Pure Python: the best ``branches`` distinct continuations of ``text``'s suffix."""
    n = len(text)
    cands = []
    for e in range(n - 1):  # earlier ends only: the suffix ends at n-1
        m = 0
        while m < max_match and e - m >= 0 and n - 1 - m >= 0 and text[e - m] == text[n - 1 - m]:
            m += 1
        if m >= min_match:
            cands.append((m, e))
    cands.sort(reverse=True)  # longest first, then the later end
    out, seen = [], set()
    for m, e in cands:
        cont = tuple(text[e + 1: e + 1 + k]) + (NO_TOKEN,) * max(0, e + 1 + k - n)
        if cont in seen:
            continue
        seen.add(cont)
        out.append((cont, m))
        if len(out) == branches:
            break
    return out


def _device_lookup(texts, width, **kw):
    hist = np.full((len(texts), width), NO_TOKEN, np.int32)
    for i, t in enumerate(texts):
        hist[i, : len(t)] = t
    toks, match = lookup_continuations(jnp.asarray(hist), jnp.asarray([len(t) for t in texts], jnp.int32), **kw)
    return np.asarray(toks), np.asarray(match)


@pytest.mark.parametrize("k,branches,min_match,max_match,vocab", [
    (3, 1, 2, 4, 3), (4, 3, 1, 3, 4), (2, 4, 2, 5, 2), (5, 2, 3, 3, 3)])
def test_matcher_equals_python_reference(k, branches, min_match, max_match, vocab):
    rng = random.Random(k * 100 + branches)
    width = 40
    texts = [[rng.randrange(vocab) for _ in range(rng.randint(1, width))] for _ in range(64)]
    texts += [[1], [1, 1], [0, 1, 0, 1], [2, 2, 2, 2, 2]]  # empty history, self-overlapping runs
    toks, match = _device_lookup(texts, width, k=k, branches=branches, min_match=min_match, max_match=max_match)
    for i, t in enumerate(texts):
        want = reference_lookup(t, k=k, branches=branches, min_match=min_match, max_match=max_match)
        got = [(tuple(toks[i, w].tolist()), int(match[i, w])) for w in range(branches) if match[i, w] > 0]
        assert got == want, (t, got, want)
        assert np.all(toks[i, len(want):] == NO_TOKEN)


def test_matcher_cases():
    kw = dict(k=3, branches=2, min_match=2, max_match=4)
    # ties at equal length go to the most recent; a 3-token match beats a more recent 2-token one
    toks, match = _device_lookup([[5, 1, 2, 7, 9, 1, 2, 8, 3, 1, 2]], 16, **kw)
    assert toks[0].tolist() == [[8, 3, 1], [7, 9, 1]] and match[0].tolist() == [2, 2]
    toks, match = _device_lookup([[0, 1, 2, 7, 4, 1, 2, 8, 0, 1, 2]], 16, **kw)
    assert toks[0].tolist() == [[7, 4, 1], [8, 0, 1]] and match[0].tolist() == [3, 2]
    # a continuation that runs into the end of the text is cut there
    toks, _ = _device_lookup([[3, 4, 5, 3, 4]], 8, k=3, branches=1, min_match=2, max_match=4)
    assert toks[0, 0].tolist() == [5, 3, 4]
    toks, _ = _device_lookup([[3, 4, 3, 4]], 8, k=3, branches=1, min_match=2, max_match=4)
    assert toks[0, 0].tolist() == [3, 4, NO_TOKEN]
    # nothing to match: one token of text, or no repeated n-gram
    toks, match = _device_lookup([[7], [1, 2, 3, 4]], 8, **kw)
    assert np.all(toks == NO_TOKEN) and np.all(match == 0)


def test_trie_holds_distinct_continuations():
    rng = np.random.default_rng(0)
    for _ in range(50):
        b, w, k = 3, 4, 3
        toks = rng.integers(0, 3, (b, w, k)).astype(np.int32)
        cut = rng.integers(0, k + 1, (b, w))  # truncated continuations
        toks = np.where(np.arange(k)[None, None] >= cut[..., None], NO_TOKEN, toks)
        root = jnp.asarray(rng.integers(0, 3, b), jnp.int32)
        tree, n_nodes = lookup_tree(root, jnp.asarray(toks))
        valid = np.asarray(tree.valid_bt)
        path = np.asarray(tree.path_btd)
        tokens = np.asarray(tree.tokens_bt)
        for r in range(b):
            # root-to-node token paths of valid non-root nodes = the distinct non-empty prefixes
            got = sorted(tuple(tokens[r, [n for n in path[r, i] if n >= 0]][1:].tolist())
                         for i in range(1, tokens.shape[1]) if valid[r, i])
            want = sorted({tuple(c[:j]) for c in toks[r].tolist() for j in range(1, k + 1)
                           if NO_TOKEN not in c[:j]})
            assert got == want
            # siblings are distinct tokens; n_nodes covers every valid node
            parents = np.asarray(tree.parents_bt)[r]
            kids = [(parents[i], tokens[r, i]) for i in range(1, tokens.shape[1]) if valid[r, i]]
            assert len(kids) == len(set(kids))
            last = max([i for i in range(tokens.shape[1]) if valid[r, i]])
            assert int(n_nodes[r]) == last + 1


# ----------------------------------------------------------------------------- in the loop

# prompts of different lengths whose tiny-target continuations repeat, so lookup has matches
PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 0, 4, 5]]


def _lookup_params(spec, tp):
    return own(spec, tp, {})


DRAFTERS = [
    ("eagle3", PromptLookup(k=3)),
    ("eagle3", PromptLookup(k=3, branches=3, min_match=1)),
    ("eagle3", PromptLookup(k=4, pass_widths=(1, 2, 3))),
    ("eagle3", Hybrid(HeadDrafter(plans.parse_plan("chain:3")), PromptLookup(k=3))),
    ("confu", Hybrid(HeadDrafter(plans.parse_plan("chain:2")), PromptLookup(k=2, min_match=1))),
]


@pytest.mark.slow
@pytest.mark.parametrize("variant,drafter", DRAFTERS, ids=[d.describe() for _, d in DRAFTERS])
def test_greedy_equals_ar(variant, drafter):
    spec, tp, params = make(variant, 6)
    if isinstance(drafter, PromptLookup):
        params = _lookup_params(spec, tp)
    ar = generate_ar(tp, spec.target, PROMPTS, max_new_tokens=30, eos_ids=())
    sp = loop.generate_speculative(params.target, drafter, params.drafter_params, PROMPTS, max_new_tokens=30,
                                   eos_ids=())
    assert generated_rows(sp, 2) == generated_rows(ar, 2)
    log, passes = np.asarray(sp.accept_log_bi), np.asarray(sp.n_passes_b)
    assert np.array_equal(log.sum(1) + 1, np.asarray(sp.n_generated_b))
    assert np.max(log) > 1 and np.all(passes < 29)  # the drafts were accepted, not just lossless
    # EOS inside a draft: stop at a token each row emits mid-text; rows stop at different times
    eos = generated_rows(ar, 2)[0][11]
    ar_e = generate_ar(tp, spec.target, PROMPTS, max_new_tokens=30, eos_ids=(eos,))
    sp_e = loop.generate_speculative(params.target, drafter, params.drafter_params, PROMPTS, max_new_tokens=30,
                                     eos_ids=(eos,))
    assert generated_rows(sp_e, 2) == generated_rows(ar_e, 2)
    assert np.array_equal(np.asarray(sp_e.stop_reason_b), np.asarray(ar_e.stop_reason_b))


@pytest.mark.slow
def test_no_match_iteration_is_an_ar_step():
    """With nothing to match (min_match above anything the text repeats) every pass verifies the
    root alone: the narrow branch runs, one token per pass, and the output is still AR's."""
    spec, tp, _ = make("eagle3", 24)
    params = _lookup_params(spec, tp)
    prompts = [[1, 2, 3, 4, 5, 6, 7]]
    drafter = PromptLookup(k=3, min_match=4, max_match=4)
    sp = loop.generate_speculative(params.target, drafter, params.drafter_params, prompts, max_new_tokens=6, eos_ids=())
    ar = generate_ar(tp, spec.target, prompts, max_new_tokens=6, eos_ids=())
    assert generated_rows(sp, 1) == generated_rows(ar, 1)
    # the width chosen: 1 while no active row has a match, else the full tree
    idx = loop.pass_width_index((1, 4), jnp.asarray([1, 4, 1]), jnp.asarray([True, False, True]))
    assert int(idx) == 0
    assert int(loop.pass_width_index((1, 2, 4), jnp.asarray([1, 2]), jnp.asarray([True, True]))) == 1
    assert int(loop.pass_width_index((1, 2, 4), jnp.asarray([3, 2]), jnp.asarray([True, True]))) == 2


@pytest.mark.slow
@pytest.mark.parametrize("which", ["lookup_tree", "hybrid"])
def test_sampling_lossless_joint(which):
    spec, tp, params = make("eagle3", 4, seed=3, n_layers=4, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64)
    if which == "lookup_tree":
        drafter, params = PromptLookup(k=2, branches=2, min_match=1), _lookup_params(spec, tp)
    else:
        drafter = Hybrid(HeadDrafter(plans.parse_plan("chain:2")), PromptLookup(k=2, min_match=1))
    assert_sampling_is_lossless(spec, tp, params, drafter, seed=200)


def test_parse_drafter():
    assert families.parse_drafter("lookup", "chain:4") == PromptLookup(k=4)
    assert families.parse_drafter("lookup", "lookup:4,2") == PromptLookup(k=4, branches=2)
    assert families.parse_drafter("lookup", "lookup:4,1,3,5") == PromptLookup(k=4, min_match=3, max_match=5)
    assert families.parse_drafter("eagle3", "dynamic:3,3,8") == HeadDrafter(plans.parse_plan("dynamic:3,3,8"))
    h = families.parse_drafter("hybrid", "chain:3")
    assert isinstance(h, Hybrid) and h.lookup.k == 3 and h.n_nodes == 4
    for method, text, msg in (("lookup", "dynamic:3,3,8", "expected chain:K or lookup"),
                              ("hybrid", "dynamic:3,3,8", "hybrid decoding drafts chains"),
                              ("lookup", "lookup:0", "k >= 1"), ("lookup", "lookup:3,1,4,2", "min_match <= max_match"),
                              ("ar", "chain:3", "does not draft")):
        with pytest.raises(ValueError, match=msg):
            families.parse_drafter(method, text)


# ----------------------------------------------------------------------------- benchmark, budget auto


@pytest.mark.slow
def test_benchmark_mixed_families_resume(tmp_path):
    """AR, a head, lookup and hybrid in one benchmark: every row lossless, plans a family cannot
    read skipped, budget auto per family, and a rerun resumes every unit from ``<out>.parts``."""
    import os

    from confu_jax.bench import cli_args, spec_bench
    from confu_jax.bench.prompts import load_question_file
    from confu_jax.data.chat import ChatTokenizer
    from confu_jax.weights import load_model
    from tests.helpers.tiny_chat_model import tiny_chat_gguf

    fixture = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "specbench_sample.jsonl")
    gguf = tiny_chat_gguf(tmp_path)
    cfg, params = load_model(gguf)
    prompts = load_question_file(fixture)[:2]
    setup = spec_bench.BenchSetup(cfg, params, ChatTokenizer.load(gguf), max_new_tokens=12, min_bucket=64,
                                  auto_candidates={None: ("chain:2",)})
    budgets = cli_args.parse_budgets("chain:2,lookup:3,2,auto")
    assert budgets == ["chain:2", "lookup:3,2", "auto"]
    kw = dict(methods=["ar", "eagle3", "lookup", "hybrid", "auto"], temperatures=[0.0], budgets=budgets, heads={})
    parts = spec_bench.Parts(str(tmp_path / "parts"), {"test": 1})
    messages = []
    rows = spec_bench.run_benchmark(setup, prompts, log=messages.append, parts=parts, **kw)
    keys = [(r["method"], r["budget"]) for r in rows]
    assert keys == [("ar", None), ("eagle3", "chain:2"), ("eagle3", "auto"), ("lookup", "chain:2"),
                    ("lookup", "lookup:3,2"), ("lookup", "auto"), ("hybrid", "chain:2"), ("hybrid", "auto"),
                    ("auto", "auto")]
    assert any("lookup:3,2 is not a head plan: skipped" in m for m in messages)
    # method auto: the best (family, plan) among every method's calibrated candidates, each method
    # calibrated once (its own auto row reused the same measurements)
    assert sum("budget auto: ar:" in m for m in messages) == 3
    chosen = rows[-1]
    assert chosen["setting"]["plan"] == "ar" or chosen["setting"]["method"] in ("eagle3", "lookup", "hybrid")
    for r in rows[1:]:
        assert r["lossless_greedy"] is True, r
        assert 1.0 <= r["tau"] <= r["nodes"]
    assert rows[4]["nodes"] == 7  # lookup:3,2: a trie of 2 continuations of 3 tokens
    assert not any("UNTRAINED" in m and m.startswith("[lookup]") for m in messages)
    again = []
    rows2 = spec_bench.run_benchmark(setup, prompts, log=again.append, parts=parts, **kw)
    assert [(r["method"], r["budget"], r["tokens_per_s"]) for r in rows2] == \
        [(r["method"], r["budget"], r["tokens_per_s"]) for r in rows]
    assert sum("finished in an earlier run" in m for m in again) == len(rows)


@pytest.mark.slow
def test_budget_auto_lookup_candidates():
    from confu_jax.bench import budget

    spec, tp, _ = make("eagle3", 6)
    params = _lookup_params(spec, tp)
    best, cands = budget.auto_plan(params.target, params.drafter_params, PROMPTS, chains=("chain:2", "chain:4"), trees=("lookup:3,2",),
                                   max_new_tokens=16, method="lookup")
    assert [c.plan for c in cands] == [budget.AR, "chain:2", "chain:4", "lookup:3,2"]
    assert all(c.method == "lookup" for c in cands)
    assert best == max(cands, key=lambda c: c.tokens_per_s)
    assert budget.plan_nodes("lookup:3,2", "lookup") == 7 and budget.plan_nodes("chain:3", "hybrid") == 4
    # the repetitive tiny target: lookup accepts several tokens per pass
    assert max(c.expected_tau for c in cands) > 1.5
    assert budget.default_candidates("lookup")[1] == lookup.DEFAULT_LOOKUP_TREES
    assert budget.default_candidates("hybrid")[1] == ()


@pytest.mark.slow
def test_method_budgets_and_quickstart_release_heads(tmp_path):
    """``run_benchmark(method_budgets=...)`` runs only the named budgets for those methods (the
    quickstart's fixed plans + method auto's budget auto); the quickstart's released heads are
    hash-checked (``runs.head_release.find_released_heads``): the repo's EAGLE-3 release is found, a
    folder without it yields nothing, an altered copy is refused."""
    import os
    import shutil

    from confu_jax.bench import spec_bench
    from confu_jax.bench.prompts import load_question_file
    from confu_jax.data.chat import ChatTokenizer
    from confu_jax.runs.head_release import HeadReleaseError, find_released_heads
    from confu_jax.weights import load_model
    from tests.helpers.tiny_chat_model import tiny_chat_gguf

    fixture = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "specbench_sample.jsonl")
    gguf = tiny_chat_gguf(tmp_path)
    cfg, params = load_model(gguf)
    setup = spec_bench.BenchSetup(cfg, params, ChatTokenizer.load(gguf), max_new_tokens=8, min_bucket=64,
                                  auto_candidates={None: ("chain:2",)})
    rows = spec_bench.run_benchmark(setup, load_question_file(fixture)[:1], methods=["ar", "lookup", "auto"],
                                    temperatures=[0.0], budgets=["chain:2", "auto"], heads={},
                                    method_budgets={"auto": ["auto"], "lookup": ["chain:2"]}, log=lambda m: None)
    assert [(r["method"], r["budget"]) for r in rows] == [("ar", None), ("lookup", "chain:2"), ("auto", "auto")]

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "releases", "heads")
    heads = find_released_heads(root, ("eagle3", "confu"))
    assert set(heads) >= {"eagle3"} and heads["eagle3"][1]["name"] == "smollm2_eagle3"
    assert find_released_heads(str(tmp_path / "empty"), ("eagle3",)) == {}
    copy = tmp_path / "rel" / "smollm2_eagle3"
    shutil.copytree(heads["eagle3"][0], copy)
    with open(copy / "config.json", "a") as f:
        f.write(" ")
    with pytest.raises(HeadReleaseError, match="config.json"):
        find_released_heads(str(tmp_path / "rel"), ("eagle3",))
