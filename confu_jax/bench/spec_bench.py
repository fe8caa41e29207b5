"""Speculative-decoding benchmark: methods × temperatures × budgets over Spec-Bench-format prompts.

For every temperature the AR baseline runs first on every question; each speculative (method,
budget) then decodes the same questions with the same settings. Per row: τ (Spec-Bench: pooled
tokens per target pass), tokens/s of compiled programs (compilation timed apart, once per shape
bucket), speed-up vs the AR baseline of the same run, per-category τ / SR, and — at temperature 0
— a losslessness check: the speculative token ids equal AR's for every prompt and turn; a
divergence where the target's two candidates are within its numerical tie tolerance in both
programs' arithmetic is a tie, not a failure (``bench.lossless``; mismatches and ties are counted
and the first one reported with both logit gaps). Heads come from ``launch.train`` workdirs, or are
random (flagged ``trained: false`` in the row) when none is given.

Multi-turn: turn 2 replays each method's own turn-1 answer (FastChat's MT-Bench protocol), so in
a lossless greedy run both see identical prompts.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from confu_jax import progress, storage
from confu_jax.bench import intervals, metrics
from confu_jax.bench.prompts import BenchPrompt, first_turn_ids, run_conversation


class _Programs:
    """One AOT-compiled program per (jit function, static args, argument shapes); compile time kept.

    A new program is run once, untimed, before ``get`` returns it: the first execution of a freshly
    compiled XLA:CPU executable costs more than the ones after it (SmolLM2's AR program at 64 tokens:
    3.60 s, then 2.96–3.11 s), and a row timing it put that one-time cost into its first question of
    every prompt width (the quickstart's lookup row measured those questions 27–41% slower than the
    same program reused by the auto row, the others alike: docs/RESULTS.md "The main job"). Budget
    auto's calibration warms its programs the same way (``budget._warm``)."""

    def __init__(self):
        self.cache, self.compile_s = {}, 0.0

    def get(self, jitted, params: tuple, args, static):
        """``params``: the program's parameter arguments, in order (the target's, or the loop's two trees)."""
        key = (id(jitted), tuple(getattr(a, "shape", ()) for a in args), tuple(sorted(static.items())))
        if key not in self.cache:
            import jax

            t0 = time.perf_counter()
            with progress.phase(f"compiling {getattr(jitted, '__name__', 'a decode program')} "
                                f"({', '.join(f'{k}={v}' for k, v in sorted(static.items()))})"[:100]):
                compiled = jitted.lower(*params, *args, **static).compile()
            self.compile_s += time.perf_counter() - t0
            jax.block_until_ready(compiled(*params, *args))  # the first execution, untimed (see above)
            self.cache[key] = compiled
        return self.cache[key]


@dataclasses.dataclass
class BenchSetup:
    target_cfg: object
    target_params: dict
    tokenizer: object  # ChatTokenizer-like: render, encode, decode, eos_ids
    max_new_tokens: int = 128
    turns: int = 1
    top_p: float = 1.0
    seed: int = 0
    min_bucket: int = 64
    system: Optional[str] = None
    # budget 'auto' candidates: {family: plans}, None = for every family (bench.cli_args.parse_auto_candidates);
    # a family absent from it measures its record's defaults (decode.families)
    auto_candidates: Optional[Mapping] = None
    # budget 'auto' calibrates on these token-id prompts, not on the measured questions (None: the
    # first two measured questions, with a warning that the choice is fitted to them)
    calibration: Optional[tuple] = None
    # decode AR again after a temperature's last row ('ar_again'; its speed-up is against the first
    # AR row, so ~1 when the machine kept its speed): every speed-up compares rows run minutes
    # apart, and on a shared 2-core VM the same row has measured 14% apart in two runs
    ar_again: bool = False
    # run every row question by question, in turn (the first row rotating), instead of one row over
    # all questions after another: a drift of the machine's speed then falls on every row alike
    # (all rows' programs stay compiled together: a few rows, not dozens)
    interleave: bool = False
    # the target's layers as per-layer buffers (True) or one scan (False) in every program the run
    # compiles (rows and calibration); None: the backend's default (decode.requests.default_unroll_layers)
    unroll_layers: Optional[bool] = None
    # decode over this device mesh (decode.sharded: weights placed by the training table once, rows over
    # data × fsdp); None: one device
    mesh: Optional[object] = None


def _turn_runner(setup: BenchSetup, programs: _Programs, decode_one: Callable, record: list):
    """generate_turn for ``run_conversation``: chat template -> ids -> decode_one -> text, log."""
    tok = setup.tokenizer

    def generate_turn(messages):
        ids = tok.encode(tok.render(messages, add_generation_prompt=True))
        tokens, accept, wall = decode_one(ids)
        record.append((ids, tokens))
        text = tok.decode([t for t in tokens if t not in tok.eos_ids], skip_special_tokens=True).strip()
        return text, accept, len(tokens), wall

    return generate_turn


def _ar_decoder(setup: BenchSetup, programs: _Programs, temperature: float):
    import jax

    from confu_jax.decode.generate import generate_padded_jit, prepare_ar_inputs

    def decode_one(ids):
        args, static = prepare_ar_inputs(setup.target_cfg, [ids], max_new_tokens=setup.max_new_tokens,
                                         temperature=temperature, top_p=setup.top_p, seed=setup.seed,
                                         eos_ids=setup.tokenizer.eos_ids, min_bucket=setup.min_bucket,
                                         unroll_layers=setup.unroll_layers, mesh=setup.mesh)
        fn = programs.get(generate_padded_jit, (setup.target_params,), args, static)
        t0 = time.perf_counter()
        res = jax.block_until_ready(fn(setup.target_params, *args))
        wall = time.perf_counter() - t0
        n = int(np.asarray(res.n_generated_b)[0])
        return np.asarray(res.tokens_bn)[0, :n].tolist(), [1] * (n - 1), wall

    return decode_one


def _spec_decoder(setup: BenchSetup, programs: _Programs, head, plan, temperature: float):
    import jax

    from confu_jax.decode.loop import prepare_spec_inputs, speculative_padded_jit

    def decode_one(ids):
        args, static = prepare_spec_inputs(head.target.config, plan, [ids], max_new_tokens=setup.max_new_tokens,
                                           temperature=temperature, top_p=setup.top_p, seed=setup.seed,
                                           eos_ids=setup.tokenizer.eos_ids, min_bucket=setup.min_bucket,
                                           unroll_layers=setup.unroll_layers, mesh=setup.mesh)
        params = (head.target, head.drafter_params)
        fn = programs.get(speculative_padded_jit, params, args, static)
        t0 = time.perf_counter()
        res = jax.block_until_ready(fn(*params, *args))
        wall = time.perf_counter() - t0
        n = int(np.asarray(res.n_generated_b)[0])
        passes = int(np.asarray(res.n_passes_b)[0])
        return (np.asarray(res.tokens_bn)[0, :n].tolist(), np.asarray(res.accept_log_bi)[0, :passes].tolist(),
                wall)

    return decode_one


def _run_all(prompts, setup, programs, decode_one, progress):
    logs, tokens = [], []
    for p in prompts:
        _, turn_logs = run_conversation(p, _turn_runner(setup, programs, decode_one, tokens),
                                        n_turns=setup.turns, system=setup.system)
        logs.extend(turn_logs)
        if progress:
            progress()
    return logs, tokens


def _run_interleaved(prompts, setup, runs: dict, progress) -> dict:
    """{key: (logs, tokens)} of every ``runs`` {key: decode_one}, question by question: question i
    is decoded by every row, the row that goes first rotating with i."""
    keys = list(runs)
    out = {k: ([], []) for k in keys}
    for i, p in enumerate(prompts):
        for k in keys[i % len(keys):] + keys[:i % len(keys)]:
            logs, tokens = out[k]
            _, turn_logs = run_conversation(p, _turn_runner(setup, None, runs[k], tokens),
                                            n_turns=setup.turns, system=setup.system)
            logs.extend(turn_logs)
        if progress:
            progress()
    return out


class Parts:
    """Finished benchmark units (one row: AR at a temperature, or a method x budget x temperature)
    kept on disk so that a killed benchmark resumes without redoing them.

    ``directory/settings.json`` holds what the units depend on (questions, lengths, heads, ...); a
    rerun with other settings is refused rather than mixing two benchmarks in one table. Each unit
    is ``<key>.json`` = {row, logs, tokens}, written atomically once the unit is complete (the folder
    may be on ``gs://``: ``confu_jax.storage``). Timings
    of resumed units come from the run that measured them: resume on the same idle machine.
    """

    def __init__(self, directory: str, settings: dict):
        import json
        import os

        self.directory = directory
        storage.makedirs(directory)
        path = os.path.join(directory, "settings.json")
        settings = json.loads(json.dumps(settings, default=str))
        if storage.exists(path):
            saved = json.loads(storage.read_text(path))
            if saved != settings:
                diff = sorted(k for k in set(saved) | set(settings) if saved.get(k) != settings.get(k))
                raise ValueError(f"{directory} holds units of a benchmark with other settings (differing: "
                                 f"{diff}); delete it or write the results elsewhere (--out)")
        else:
            storage.write_text(path, json.dumps(settings, indent=1))

    def _path(self, key: str) -> str:
        import os

        return os.path.join(self.directory, key.replace("/", "_").replace(":", "-") + ".json")

    def load(self, key: str):
        """-> (row, logs, tokens) of a finished unit, or None."""
        import json

        path = self._path(key)
        if not storage.exists(path):
            return None
        obj = json.loads(storage.read_text(path))
        logs = [metrics.GenerationLog.from_json(g) for g in obj["logs"]]
        return obj["row"], logs, [(list(a), list(b)) for a, b in obj["tokens"]]

    def save(self, key: str, row: dict, logs, tokens) -> None:
        import json

        from confu_jax.bench.report import result_to_json

        storage.write_text(self._path(key), json.dumps(  # whole or not at all (locally tmp + rename)
            {"row": result_to_json(row), "logs": [g.to_json() for g in logs],
             "tokens": [[list(map(int, a)), list(map(int, b))] for a, b in tokens]}))


def _compare(setup: BenchSetup, ar_turns, sp_turns, turns_index) -> dict:
    """Greedy losslessness: token-for-token equality, a divergence within the target's numerical
    tie tolerance excepted (``bench.lossless``: the first divergence with both programs' margins)."""
    from confu_jax.bench.lossless import compare_greedy

    return compare_greedy(setup.target_params, setup.target_cfg, turns_index, ar_turns, sp_turns)


def _bar(progress_factory, total: int, desc: str):
    """(progress bar or None, its tick) over ``total`` questions."""
    if progress_factory is None:
        return None, lambda: None
    b = progress_factory(total=total, desc=desc)
    return b, b.update


def _ar_row(method: str, logs, ar_logs, *, temperature: float, compile_s: float, seed: int, **extra) -> dict:
    """A result row of an AR decode (the baseline, or AR again against it): no head, no plan."""
    res = metrics.summarize(method, logs, ar_logs, temperature=temperature)
    row = dict(dataclasses.asdict(res), compile_s=compile_s, budget=None, head=None, trained=None)
    row.update({"lossless_greedy": None, **extra})
    return intervals.annotate(row, logs, ar_logs, seed=seed)


def _spec_row(method: str, logs, ar_logs, *, plan, setting: dict, budget: str, head, temperature: float,
              compile_s: float, seed: int, **extra) -> dict:
    """A result row of a speculative decode of ``head`` with drafter ``plan`` against the AR row;
    ``extra``: the lossless check's fields and labels."""
    res = metrics.summarize(method, logs, ar_logs, nodes=plan.n_nodes, temperature=temperature,
                            depth=plan.max_depth, setting=setting)
    row = dict(dataclasses.asdict(res), compile_s=compile_s, budget=budget, head=head.source,
               trained=head.trained, **extra)
    return intervals.annotate(row, logs, ar_logs, seed=seed)


class _Benchmark:
    """One ``run_benchmark`` call, in its three steps: **load** every drafting method's weights once
    (on the device, or placed on the mesh), **build** what a row decodes with (``resolve``: the plan
    text, budget ``auto``'s choice from its calibrated candidates), **run** each temperature's rows
    (AR first, then every (method, budget), then AR again), kept in ``parts`` as they finish."""

    def __init__(self, setup: BenchSetup, prompts: Sequence[BenchPrompt], *, methods: Sequence[str],
                 budgets: Sequence[str], log: Callable[[str], None], progress_factory, parts: Optional[Parts],
                 method_budgets: Optional[dict]):
        from confu_jax.decode.families import get_method

        self.setup, self.prompts, self.budgets, self.log = setup, prompts, budgets, log
        self.progress_factory, self.parts, self.method_budgets = progress_factory, parts, method_budgets or {}
        self.spec_methods = [m for m in methods if get_method(m).speculative]
        self.drafting = [m for m in self.spec_methods if not get_method(m).chooses_method]
        if len(self.drafting) < len(self.spec_methods) and not self.drafting:
            raise ValueError("method 'auto' chooses among the run's other speculative methods; name some "
                             "(e.g. --methods ar,lookup,eagle3,auto)")
        self.turns_index = [(p.question_id, t) for p in prompts for t in range(min(setup.turns, len(p.turns)))]
        self.rows: list = []
        self.loaded: dict = {}
        self.calibrations: dict = {}
        self.kept: dict = {}  # parts.load per row key, read once (the interleaved pre-pass asks first)

    # ------------------------------------------------------------------------- load

    def load(self, heads: dict) -> None:
        """Every drafting method's weights, to the device once (host arrays passed to every timed call
        would be copied on every call); with a mesh, the target too, as the training table lays it out."""
        import jax

        from confu_jax.decode.families import decode_head, get_method

        setup = self.setup
        host_target = setup.target_params
        if setup.mesh is not None:
            from confu_jax.decode.sharded import place_params, place_target

            self.setup = setup = dataclasses.replace(
                setup, target_params=place_target(setup.target_params, setup.target_cfg, setup.mesh))
        for m in self.drafting:
            head = decode_head(m, setup.target_cfg, host_target, heads.get(m), seed=setup.seed,
                               target_tokenizer=setup.tokenizer)  # a draft model's tokenizer is checked against it
            target, dp = ((jax.device_put(head.target), jax.device_put(head.drafter_params)) if setup.mesh is None
                          else place_params(head.target, head.drafter_params, setup.mesh))
            self.loaded[m] = head._replace(target=target, drafter_params=dp)
            if not self.loaded[m].trained and get_method(m).needs_head:
                self.log(f"[{m}] no trained head given (--heads {m}=WORKDIR): UNTRAINED head "
                         f"({self.loaded[m].source}), tau ~ 1")

    # ------------------------------------------------------------------------- build

    def calibrate(self, m: str) -> list:
        """Budget auto's measured candidates of method m (greedy, on the calibration prompts; once per
        run: a method's auto rows at every temperature and method auto reuse them)."""
        from confu_jax.bench import budget as budget_lib
        from confu_jax.bench.cli_args import plan_families
        from confu_jax.decode.families import fits_head, get_method

        if m not in self.calibrations:
            setup = self.setup
            calib = setup.calibration
            if calib is None:
                self.log(f"[{m}] budget auto: no held-out calibration prompts given; calibrating on "
                         "the first two measured questions (the choice is fitted to them)")
                calib = [first_turn_ids(setup.tokenizer, p) for p in self.prompts[:2]]
            chains, trees = budget_lib.default_candidates(m)
            fam = get_method(m).family  # given candidates: each method measures those its family reads
            given = setup.auto_candidates or {}
            if fam in given or None in given:
                chains, trees = given.get(fam, given.get(None)), ()
            chains = tuple(c for c in chains if fam in plan_families(c))
            trees = tuple(c for c in trees if fam in plan_families(c))
            h = self.loaded[m]
            chains, trees = (tuple(c for c in cands if fits_head(m, c, h)) for cands in (chains, trees))
            _, self.calibrations[m] = budget_lib.auto_plan(
                h.target, h.drafter_params, calib, max_new_tokens=setup.max_new_tokens, min_bucket=setup.min_bucket,
                log=self.log, chains=chains, trees=trees, method=m, interleave=setup.interleave,
                unroll_layers=setup.unroll_layers, mesh=setup.mesh)
        return self.calibrations[m]

    def resolve(self, m: str, bud: str):
        """The plan row (m, bud) decodes with -> None (skipped, logged), or (plan text, drafter, head,
        budget auto's choice or None); drafter None: budget auto chose plain AR."""
        from confu_jax.bench import budget as budget_lib
        from confu_jax.bench.cli_args import plan_families
        from confu_jax.decode.families import drafter_for, get_method

        family, chooser = get_method(m).family, get_method(m).chooses_method
        head = self.loaded.get(m)
        if chooser and bud != "auto":
            self.log(f"[{m}] chooses its own plan: budget {bud} skipped (only auto)")
            return None
        if bud != "auto" and family not in plan_families(bud):
            self.log(f"[{m}] budget {bud} is not a {family} plan: skipped")
            return None
        best, plan_text = None, bud
        if bud == "auto":
            # across families (method auto): every candidate of every drafting method competes
            cands = [c for x in (self.drafting if chooser else [m]) for c in self.calibrate(x)]
            best = budget_lib.choose(cands)
            plan_text = best.plan
            if chooser and plan_text != budget_lib.AR:
                head = self.loaded[best.method]
            self.log(f"[{m}] budget auto -> {best.method if chooser else m} {plan_text} (expected "
                     f"tau {best.expected_tau:.2f}, {best.tokens_per_s:.1f} tokens/s)")
            if plan_text == budget_lib.AR:  # speculation does not pay: decode as AR does
                return plan_text, None, head, best
        return plan_text, drafter_for(best.method if chooser else m, plan_text, head), head, best

    # ------------------------------------------------------------------------- run

    def from_parts(self, key: str):
        if key not in self.kept:
            self.kept[key] = self.parts.load(key) if self.parts is not None else None
        return self.kept[key]

    def resumed(self, key: str):
        got = self.from_parts(key)
        if got is not None:
            self.rows.append(got[0])
            self.log(f"[{key}] finished in an earlier run: {got[0]['tokens_per_s']:.2f} tokens/s (kept)")
        return got

    def keep(self, key: str, row: dict, logs, tokens) -> None:
        self.rows.append(row)
        if self.parts is not None:
            self.parts.save(key, row, logs, tokens)

    def bar(self, desc: str):
        return _bar(self.progress_factory, len(self.prompts), desc)

    def run_temperature(self, temp: float) -> None:
        """AR, every (method, budget) row, and AR again at ``temp``; interleaved question by question
        when the setup asks (every unfinished row decoded in one pre-pass, assembled in row order)."""
        from confu_jax.bench import budget as budget_lib
        from confu_jax.decode.families import get_method

        setup = self.setup
        ar_key, again_key = f"ar__T{temp:g}", f"ar_again__T{temp:g}"
        row_keys = [(m, bud, f"{m}__{bud}__T{temp:g}") for m in self.spec_methods
                    for bud in self.method_budgets.get(m, self.budgets)]
        resolved, pending, compiled = {}, {}, {}

        def resolve_once(m, bud, key):
            if key not in resolved:
                resolved[key] = self.resolve(m, bud)
            return resolved[key]

        if setup.interleave:
            pending = self._interleaved_pass(temp, ar_key, again_key, row_keys, resolve_once, compiled)

        def execute(key, make_decoder, desc):
            """(logs, tokens, programs) of one row: from the interleaved pass, else decoded now."""
            if key in pending:
                logs, tokens = pending.pop(key)
                return logs, tokens, compiled[key]
            programs = _Programs()
            b, tick = self.bar(desc)
            logs, tokens = _run_all(self.prompts, setup, programs, make_decoder(programs), tick)
            if b is not None:
                b.close()
            return logs, tokens, programs

        got = self.resumed(ar_key)
        if got is not None:
            _, ar_logs, ar_tokens = got
        else:
            ar_logs, ar_tokens, programs = execute(ar_key, lambda pr: _ar_decoder(setup, pr, temp), f"ar T={temp}")
            self.keep(ar_key, _ar_row("ar", ar_logs, ar_logs, temperature=temp, compile_s=programs.compile_s,
                                      seed=setup.seed), ar_logs, ar_tokens)
            self.log(f"[ar] T={temp}: {self.rows[-1]['tokens_per_s']:.2f} tokens/s (compile "
                     f"{programs.compile_s:.1f} s)")

        def lossless(tokens):
            """The greedy check of a row against the AR row (sampled rows: not checked)."""
            if temp != 0:
                return {"lossless_greedy": None, "n_mismatched_turns": None, "n_numerical_ties": None,
                        "first_mismatch": None}
            return _compare(setup, ar_tokens, tokens, self.turns_index)

        for m, bud, key in row_keys:
            if self.resumed(key) is not None:
                continue
            r = resolve_once(m, bud, key)
            if r is None:
                continue
            plan_text, plan, head, best = r
            if plan is None:  # budget auto chose AR: the row is the AR decode itself
                self.keep(key, _chose_ar_row(m, bud, plan_text, head, ar_logs, temperature=temp, seed=setup.seed),
                          ar_logs, ar_tokens)
                self.log(f"[{m}] {bud} (ar: speculation off) T={temp}: {self.rows[-1]['tokens_per_s']:.2f} tokens/s")
                continue
            sp_logs, sp_tokens, programs = execute(
                key, lambda pr, head=head, plan=plan: _spec_decoder(setup, pr, head, plan, temp), f"{m} {bud} T={temp}")
            setting = {"plan": plan_text, "budget": bud}
            if get_method(m).chooses_method:
                setting["method"] = best.method  # the family budget auto chose
            row = _spec_row(m, sp_logs, ar_logs, plan=plan, setting=setting, budget=bud, head=head,
                            temperature=temp, compile_s=programs.compile_s, seed=setup.seed,
                            **lossless(sp_tokens), **({"interleaved": True} if setup.interleave else {}))
            self.keep(key, row, sp_logs, sp_tokens)
            self.log(f"[{m}] {bud} ({plan_text}) T={temp}: tau {row['tau']:.3f}, {row['tokens_per_s']:.2f} "
                     f"tokens/s, speed-up {row['speedup']:.3f}, compile {programs.compile_s:.1f} s"
                     + ("" if temp != 0 else f", lossless={row['lossless_greedy']}"))
            del programs
            if not pending:
                budget_lib.release_compiled()  # one row's programs are never reused (mmap limit)
        if setup.ar_again and self.resumed(again_key) is None:
            again_logs, again_tokens, programs = execute(
                again_key, lambda pr: _ar_decoder(setup, pr, temp), f"ar again T={temp}")
            row = _ar_row("ar_again", again_logs, ar_logs, temperature=temp, compile_s=programs.compile_s,
                          seed=setup.seed, **lossless(again_tokens))
            self.keep(again_key, row, again_logs, again_tokens)
            ci = row.get("speedup_ci") or [float("nan")] * 2
            self.log(f"[ar again] T={temp}: {row['tokens_per_s']:.2f} tokens/s, {row['speedup']:.3f}x the first AR "
                     f"row [{ci[0]:.3f}, {ci[1]:.3f}] (machine speed drift over the run)")
            del programs
        compiled.clear()
        budget_lib.release_compiled()

    def _interleaved_pass(self, temp, ar_key, again_key, row_keys, resolve_once, compiled) -> dict:
        """Decode every unfinished row of ``temp`` question by question -> {key: (logs, tokens)};
        ``compiled`` gets each row's programs (their compile times go into the rows)."""
        setup = self.setup
        runs = {}
        if self.from_parts(ar_key) is None:
            compiled[ar_key] = _Programs()
            runs[ar_key] = _ar_decoder(setup, compiled[ar_key], temp)
        for m, bud, key in row_keys:
            r = None if self.from_parts(key) is not None else resolve_once(m, bud, key)
            if r is not None and r[1] is not None:
                compiled[key] = _Programs()
                runs[key] = _spec_decoder(setup, compiled[key], r[2], r[1], temp)
        if setup.ar_again and self.from_parts(again_key) is None:
            compiled[again_key] = _Programs()
            runs[again_key] = _ar_decoder(setup, compiled[again_key], temp)
        if not runs:
            return {}
        b, tick = self.bar(f"{len(runs)} rows interleaved T={temp}")
        pending = _run_interleaved(self.prompts, setup, runs, tick)
        if b is not None:
            b.close()
        return pending


def _chose_ar_row(method: str, budget: str, plan_text: str, head, ar_logs, *, temperature: float, seed: int) -> dict:
    """The row of a (method, budget) whose budget auto chose plain AR: the AR decode itself."""
    res = metrics.summarize(method, ar_logs, ar_logs, nodes=1, temperature=temperature, depth=None,
                            setting={"plan": plan_text, "budget": budget})
    greedy = temperature == 0
    return intervals.annotate(
        dict(dataclasses.asdict(res), compile_s=0.0, budget=budget, head=None if head is None else head.source,
             trained=None if head is None else head.trained, lossless_greedy=True if greedy else None,
             n_mismatched_turns=0 if greedy else None, n_numerical_ties=0 if greedy else None, first_mismatch=None),
        ar_logs, ar_logs, seed=seed)


def run_benchmark(setup: BenchSetup, prompts: Sequence[BenchPrompt], *, methods: Sequence[str],
                  temperatures: Sequence[float], budgets: Sequence[str], heads: dict,
                  log: Callable[[str], None] = print, progress_factory=None,
                  parts: Optional[Parts] = None, method_budgets: Optional[dict] = None) -> list[dict]:
    """-> result rows (report.write_results layout) for AR and every (method, budget, temperature).

    With ``parts``, every finished row is kept on disk and a rerun skips the rows it finds there.
    ``method_budgets`` {method: budgets}: those methods run only these budgets (e.g. budget ``auto``
    for method ``auto`` alone, fixed plans for the others).
    """
    bench = _Benchmark(setup, prompts, methods=methods, budgets=budgets, log=log, progress_factory=progress_factory,
                       parts=parts, method_budgets=method_budgets)
    bench.load(heads)
    for temp in temperatures:
        bench.run_temperature(temp)
    return bench.rows


def checkpoint_rows(setup: BenchSetup, prompts: Sequence[BenchPrompt], *, method: str,
                    sources: Sequence[tuple[str, str]], budgets: Sequence[str],
                    log: Callable[[str], None] = print, progress_factory=None) -> list[dict]:
    """Greedy rows of one method's heads at several checkpoints (``sources``: (label, head source),
    e.g. ('step 64', 'runs/e3@64')) against one AR baseline — the points of a scaling curve.

    Why not ``run_benchmark`` once per checkpoint: the heads of one run share their architecture, so
    a budget's program is compiled once and every checkpoint's parameters go through it (compiles
    cost more than decoding a few held-out questions on a CPU). Each row is ``run_benchmark``'s (τ
    with its interval, lossless check against AR, speed-up) plus ``label``.
    """
    import jax

    from confu_jax.bench import budget as budget_lib
    from confu_jax.decode.families import check_plan, decode_head, parse_drafter

    def bar(desc):
        return _bar(progress_factory, len(prompts), desc)

    turns_index = [(p.question_id, t) for p in prompts for t in range(min(setup.turns, len(p.turns)))]
    programs = _Programs()
    b, tick = bar("ar")
    ar_logs, ar_tokens = _run_all(prompts, setup, programs, _ar_decoder(setup, programs, 0.0), tick)
    if b is not None:
        b.close()
    rows = [_ar_row("ar", ar_logs, ar_logs, temperature=0.0, compile_s=programs.compile_s, seed=setup.seed,
                    label="ar")]
    log(f"[ar] {rows[0]['tokens_per_s']:.2f} tokens/s")
    del programs
    for bud in budgets:
        plan = parse_drafter(method, bud)
        programs = _Programs()  # shared by every checkpoint of this budget
        for label, source in sources:
            head = decode_head(method, setup.target_cfg, setup.target_params, source, seed=setup.seed,
                               target_tokenizer=setup.tokenizer)
            check_plan(method, plan, head)
            head = head._replace(target=jax.device_put(head.target), drafter_params=jax.device_put(head.drafter_params))
            b, tick = bar(f"{label} {bud}")
            sp_logs, sp_tokens = _run_all(prompts, setup, programs, _spec_decoder(setup, programs, head, plan, 0.0),
                                          tick)
            if b is not None:
                b.close()
            row = _spec_row(method, sp_logs, ar_logs, plan=plan, setting={"plan": bud, "budget": bud},
                            budget=bud, head=head, temperature=0.0, compile_s=programs.compile_s,
                            seed=setup.seed, label=label, **_compare(setup, ar_tokens, sp_tokens, turns_index))
            rows.append(row)
            log(f"[{method} {label}] {bud}: tau {row['tau']:.3f} {row['tau_ci']}, lossless={row['lossless_greedy']}")
        del programs
        budget_lib.release_compiled()
    return rows
