"""The campaign's training and benchmark stages: eagle3, confu, families, bench (methods of
``driver.Campaign``)."""

from __future__ import annotations

import os
import re
import shutil
import sys
import time

from experiments.gpu_campaign import common
from experiments.gpu_campaign.common import (CAMPAIGN_FAMILIES, CPU_RELEASE, CampaignError, RELEASE_NAME,
                                             bench_summary, checkpoint_steps, dir_bytes, family_record, format_row,
                                             head_info, metrics_rows, write_json)
from experiments.gpu_campaign.steps import auto_candidates


class TrainStages:
    """eagle3, confu, the other families and the benchmark; mixed into ``driver.Campaign``."""

    def train_overrides(self, run: str) -> list[str]:
        s = self.scale
        fb = self.stage(run).get("fallback", {})
        train_files = self.training_releases()
        o = {
            "data.train_files": ",".join(train_files), "data.max_length": s.train_len,
            # the families whose training reads padded rows (``catalog.Entry.packs_rows`` false: Medusa, the
            # MLP speculator, DFlash) carry fewer answer tokens at the same rows x length (the campaign's
            # token-steps); their metrics.csv says how many they saw
            "data.global_batch_size": self.train_batch(run), "data.pack": family_record(run).packs_rows,
            "data.min_loss_tokens": 1, "data.num_workers": fb.get("num_workers", s.num_workers),
            "data.draft_vocab_max_records": s.draft_vocab_records,
            "draft.draft_vocab_size": s.draft_vocab, "draft.ttt_steps": s.ttt_steps,
            "model.attention_impl": "xla", "train.optim.lr": s.lr, "train.optim.warmup_steps": s.warmup,
            "train.checkpoint.every": s.ckpt_every, "train.checkpoint.keep": 1000,
            "train.log_every": s.log_every, "train.eval_every": s.eval_every, "train.milestones": s.milestones,
            "train.progress_bar": False, "train.tensorboard": "off", "objective.eval_batches": s.eval_batches,
        }
        if s.eval_batches == 0:
            o["objective.eval_records"] = 0
        if s.train_dtype:
            o.update({"model.dtype": s.train_dtype, "model.param_dtype": s.train_dtype, "draft.dtype": s.train_dtype})
        if s.model_preset:
            o["model.preset"] = s.model_preset
        return [f"--config.{k}={v}" for k, v in o.items()]

    def training_releases(self) -> list[str]:
        """This campaign's releases, the repository's campaign releases it does not continue, and
        the CPU release last (held-out evaluation takes the last source's last conversations)."""
        def releases_in(folder: str) -> dict:
            names = sorted(os.listdir(folder)) if folder and os.path.isdir(folder) else []
            return {n: os.path.join(folder, n) for n in names
                    if os.path.isfile(os.path.join(folder, n, "manifest.json"))}

        mine = releases_in(self.path("release"))
        repo = releases_in(os.path.join(common.ROOT, self.scale.repo_releases) if self.scale.repo_releases else "")
        theirs = {n: p for n, p in repo.items() if n.startswith(RELEASE_NAME) and n not in mine}
        files = list(mine.values()) + list(theirs.values())
        if os.path.isdir(os.path.join(common.ROOT, CPU_RELEASE)):
            files.append(os.path.join(common.ROOT, CPU_RELEASE))
        return files

    def train_env(self) -> dict:
        """Training's extra XLA flags (``Scale.train_xla_flags``), after any the caller set."""
        flags = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), self.scale.train_xla_flags) if f)
        return {"XLA_FLAGS": flags} if flags else {}

    def train_batch(self, run: str) -> int:
        """Rows per step of ``run``: its own fallback's, else (ConFu) EAGLE-3's, else the scale's."""
        for r in (run, "eagle3"):
            b = self.stage(r).get("fallback", {}).get("train_batch")
            if b:
                return int(b)
        return self.scale.train_batch

    def fallback(self, run: str, workdir: str) -> bool:
        """After a failed training launch: retry once at half the batch and twice the steps (same
        tokens seen) when the log says the GPU ran out of memory, else once without data-loading
        worker processes (a resumable change). False when both were tried."""
        st = self.stage(run)
        fb = st.setdefault("fallback", {})
        with open(self.path("logs", f"{run}.log"), errors="replace") as f:
            tail = f.read()[-20000:]
        plan = self.plan()
        if re.search(r"RESOURCE_EXHAUSTED|[Oo]ut of memory", tail) and "train_batch" not in fb:
            fb["train_batch"] = max(1, self.train_batch(run) // 2)
            fb["steps_factor"] = 2
            shutil.rmtree(workdir, ignore_errors=True)  # another batch is another run
            if run == "eagle3":
                plan.update(e3=2 * plan["e3"], plus=2 * plan["plus"])
            self.log(f"{run}: out of GPU memory: retrying at batch {fb['train_batch']} with twice the steps")
        elif fb.get("num_workers") != 0:
            fb["num_workers"] = 0
            self.log(f"{run}: failed; retrying once without data-loading worker processes")
        else:
            return False
        self.save()
        return True

    def plan(self) -> dict:
        p = self.state.setdefault("plan", {"e3": self.scale.e3_steps, "plus": self.scale.plus_steps,
                                           "replanned": False})
        return p

    def st_eagle3(self) -> str:
        s, st, plan = self.scale, self.stage("eagle3"), self.plan()
        workdir = self.path("runs", "eagle3")
        total = plan["e3"] + plan["plus"]
        if total in checkpoint_steps(os.path.join(workdir, "checkpoints")):
            return self._finish_eagle3(workdir)
        st.setdefault("started_t", time.time())
        watch = {"t": [], "step": []}

        def poll(_proc):
            rows = metrics_rows(workdir)
            if rows:
                step = int(float(rows[-1]["step"]))
                if not watch["step"] or step != watch["step"][-1]:
                    watch["t"].append(time.time())
                    watch["step"].append(step)
            if plan["replanned"] or not s.replan or len(watch["step"]) < 4:
                return False
            return self._replan(watch)

        cmd = [sys.executable, "-m", "launch.train", "--config", "configs/smollm2_eagle3.py", "--workdir", workdir,
               *self.train_overrides("eagle3"), f"--config.train.steps={total}"]
        if s.e3_init:
            if not os.path.exists(s.e3_init):
                raise CampaignError(f"eagle3: e3_init {s.e3_init!r} is not in the working tree that travelled "
                                    f"(expected a head release or run directory)")
            cmd.append(f"--config.train.checkpoint.init_from={s.e3_init}")
        budget = self.left()
        if budget < 60:
            return "later"
        t = time.time()
        rc, stopped = self.run_cmd("eagle3", cmd, budget, on_poll=poll, extra_env=self.train_env())
        st["seconds_training"] = st.get("seconds_training", 0.0) + time.time() - t
        if rc != 0 and not stopped:
            if self.fallback("eagle3", workdir):
                return "again"
            raise CampaignError("eagle3: launch.train failed (logs/eagle3.log)")
        if plan["e3"] + plan["plus"] in checkpoint_steps(os.path.join(workdir, "checkpoints")):
            return self._finish_eagle3(workdir)
        return "again" if self.left() > 60 else "later"  # re-planned (relaunch at once) or out of time

    def _replan(self, watch) -> bool:
        """Once, from the measured step time: E and P (E = P, multiples of ckpt_every) such that the
        rest of EAGLE-3 and all of ConFu end before the training time box (and leave the benchmark
        its time). Returns True to stop EAGLE-3 for a relaunch with the new step count."""
        s, plan = self.scale, self.plan()
        ts, steps = watch["t"][1:], watch["step"][1:]  # the first point includes the compile
        sec_per_step = (ts[-1] - ts[0]) / max(1, steps[-1] - steps[0])
        done = steps[-1]
        spent = time.time() - self.stage("eagle3")["started_t"]
        box = min(s.train_s - spent, self.campaign_left() - s.bench_s - 90)
        compile_confu = 90.0
        # (E + P - done) * t + P * t * c + (E + P) * t * m <= box - compile, with E = P
        # (m: the step cost of the other families, trained for E + P steps each)
        per_unit = sec_per_step * (2 + s.confu_cost + 2 * sum(self.family_costs().values()))
        every = s.ckpt_every
        unit = int(max(0.0, box - compile_confu + done * sec_per_step) / per_unit) // every * every
        floor = -(-max(s.min_steps // 2, done + 1, 1) // every) * every  # E lies ahead of EAGLE-3's step
        unit = max(floor, min(unit, 2 * max(plan["e3"], plan["plus"]) // every * every))  # <= twice the plan
        old = (plan["e3"], plan["plus"])
        plan.update(replanned=True, sec_per_step_eagle3=round(sec_per_step, 4), replanned_at_step=done)
        self.log(f"plan: EAGLE-3 runs {sec_per_step:.3f} s/step; {box:.0f} s left for training -> E = P = {unit} "
                 f"(was E = {old[0]}, P = {old[1]})")
        if (unit, unit) == old:
            self.save()
            return False
        plan.update(e3=unit, plus=unit)
        self.save()
        return True  # stop now; the stage relaunches with train.steps = 2 * unit (a resumable change)

    def family_costs(self) -> dict:
        """{family: step time / EAGLE-3's} of the extra families this campaign trains."""
        costs = {f: getattr(self.scale, f"{f}_cost") for f in CAMPAIGN_FAMILIES}
        fams = [f for f in self.scale.families.split(",") if f]
        unknown = sorted(set(fams) - set(costs))
        if unknown:
            raise CampaignError(f"families: {unknown} not known to the campaign; expected some of {sorted(costs)}")
        return {f: costs[f] for f in fams}

    def _finish_eagle3(self, workdir: str) -> str:
        plan = self.plan()
        ck = checkpoint_steps(os.path.join(workdir, "checkpoints"))
        if plan["e3"] not in ck:
            raise CampaignError(f"eagle3: no checkpoint at E = {plan['e3']} for ConFu to start from (has {ck})")
        out = self.path("export", "eagle3_official")
        rc, _ = self.run_cmd("export_eagle3", [sys.executable, "-m", "launch.export_head", "--workdir", workdir,
                                               "--format", "eagle3", "--dtype", "bfloat16", "--out", out],
                             timeout=max(60, self.left()), cpu=True)
        if rc != 0:
            raise CampaignError("eagle3: export failed (logs/export_eagle3.log)")
        info = head_info(workdir, self.scale, plan["e3"] + plan["plus"])
        write_json(os.path.join(out, "campaign_head.json"), info)
        self.stage("eagle3")["info"] = info
        self.log(f"eagle3: {info['steps']} steps, {info['tokens_seen'] / 1e6:.1f} M token-steps; exported to "
                 f"export/eagle3_official ({dir_bytes(out) / 2**20:.1f} MiB)")
        self.add_artifact("eagle3_head", [(out, "heads/eagle3_official")])
        return "done"

    def st_confu(self) -> str:
        plan = self.plan()
        e3 = self.path("runs", "eagle3")
        workdir = self.path("runs", "confu")
        steps = plan["plus"] * self.stage("confu").get("fallback", {}).get("steps_factor", 1)
        if steps not in checkpoint_steps(os.path.join(workdir, "checkpoints")):
            s = self.scale
            cmd = [sys.executable, "-m", "launch.train", "--config", "configs/smollm2_confu.py", "--workdir", workdir,
                   *self.train_overrides("confu"), f"--config.train.steps={steps}",
                   f"--config.objective.k_train={s.k_train}", f"--config.confu.max_lag={s.max_lag}",
                   f"--config.train.checkpoint.init_from={e3}/checkpoints",
                   f"--config.train.checkpoint.init_from_step={plan['e3']}"]
            if s.confu_future_bias:
                cmd.append(f"--config.confu.future_bias={float(s.confu_future_bias)}")
            for item in s.confu_overrides.split():
                if "=" not in item:
                    raise CampaignError(f"confu_overrides: {item!r} is not key=value")
                cmd.append(f"--config.{item}")
            if self.left() < 60:
                return "later"
            rc, stopped = self.run_cmd("confu", cmd, self.left(), extra_env=self.train_env())
            if rc != 0 and not stopped:
                if self.fallback("confu", workdir):
                    return "again"
                raise CampaignError("confu: launch.train failed (logs/confu.log)")
            if steps not in checkpoint_steps(os.path.join(workdir, "checkpoints")):
                return "again" if self.left() > 60 else "later"
        out = self.path("export", "confu_bf16")
        rc, _ = self.run_cmd("export_confu", [sys.executable, "-m", "experiments.gpu_campaign", "step", "export_confu",
                                              "--workdir", workdir, "--out", out], timeout=max(60, self.left()), cpu=True)
        if rc != 0:
            raise CampaignError("confu: export failed (logs/export_confu.log)")
        info = head_info(workdir, self.scale, steps, inherited=plan["e3"],
                         inherited_tokens=self.stage("eagle3")["info"]["tokens_per_step"] * plan["e3"])
        write_json(os.path.join(out, "campaign_head.json"), info)
        self.stage("confu")["info"] = info
        self.log(f"confu: {info['steps']} steps from EAGLE-3 step {plan['e3']} ({info['tokens_seen'] / 1e6:.1f} M "
                 f"token-steps counting EAGLE-3's); exported to export/confu_bf16 ({dir_bytes(out) / 2**20:.1f} MiB)")
        self.add_artifact("confu_head", [(out, "heads/confu_bf16")])
        return "done"

    def st_families(self) -> str:
        """The other drafter families at EAGLE-3's training budget (``Scale.families``), one after
        another: the same data, rows and length for E + P steps, from each family's reference
        initialisation (the families' equal-compute protocol). Each run's info goes to ``stages.families.info``."""
        info = self.stage("families").setdefault("info", {})
        for family in self.family_costs():
            if family in info:
                continue
            result = self._train_family(family)
            if result != "done":
                return result
            info[family] = self.stage(family)["info"]
            self.save()
        return "done"

    def _train_family(self, family: str) -> str:
        plan, s = self.plan(), self.scale
        workdir = self.path("runs", family)
        steps = (plan["e3"] + plan["plus"]) * self.stage(family).get("fallback", {}).get("steps_factor", 1)
        if steps not in checkpoint_steps(os.path.join(workdir, "checkpoints")):
            cmd = [sys.executable, "-m", "launch.train", "--config", family_record(family).configs[0],
                   "--workdir", workdir, *self.train_overrides(family), f"--config.train.steps={steps}"]
            if self.left() < 60:
                return "later"
            rc, stopped = self.run_cmd(family, cmd, self.left(), extra_env=self.train_env())
            if rc != 0 and not stopped:
                if self.fallback(family, workdir):
                    return "again"
                raise CampaignError(f"{family}: launch.train failed (logs/{family}.log)")
            if steps not in checkpoint_steps(os.path.join(workdir, "checkpoints")):
                return "again" if self.left() > 60 else "later"
        info = self.stage(family)["info"] = head_info(workdir, s, steps)
        self.log(f"{family}: {steps} steps, {info['tokens_seen'] / 1e6:.1f} M token-steps (EAGLE-3's budget)")
        return "done"

    def st_bench(self) -> str:
        s, st = self.scale, self.stage("bench")
        e3, confu = self.path("runs", "eagle3"), self.path("runs", "confu")
        out = self.path("bench", "mtbench.json")
        heads = {"eagle3": e3, "confu": confu, "hybrid": e3, **{f: self.path("runs", f) for f in CAMPAIGN_FAMILIES}}
        methods = [m for m in s.bench_methods.split(",") if m]
        methods += [f for f in self.family_costs() if f not in methods]
        # launch.decode_bench, with budget auto's candidates narrowed to the scale's
        cmd = [sys.executable, "-m", "launch.decode_bench", "--methods", ",".join(methods),
               "--heads", ",".join(f"{m}={heads[m]}" for m in methods if m in heads),
               "--prompts", s.bench_prompts, "--n_per_category", s.bench_n_per_category, "--turns", "1",
               "--max_new_tokens", s.bench_max_new, "--temperatures", "0", "--budgets", s.bench_budgets,
               "--min_bucket", s.bench_min_bucket, "--out", out]
        if auto_candidates(s):
            cmd += ["--auto_candidates", auto_candidates(s)]
        if s.bench_calibration:
            cmd += ["--calibration", s.bench_calibration, "--n_calibration", "4"]
        budget = self.left()
        if budget < 60:
            return "later"
        t = time.time()
        # float32 matmuls at full precision: the lossless check compares one-token steps with block
        # passes at float32's tolerance, which TF32 (XLA's GPU default for float32 dots) would exceed
        rc, stopped = self.run_cmd("bench", cmd, budget, extra_env={"JAX_DEFAULT_MATMUL_PRECISION": "highest"})
        st["bench_seconds"] = st.get("bench_seconds", 0.0) + time.time() - t
        if rc != 0 and not stopped:
            raise CampaignError("bench: launch.decode_bench failed (logs/bench.log)")
        if not os.path.isfile(out) or stopped:
            return "later"
        summary = bench_summary(out)
        st["info"] = summary
        write_json(self.path("bench", "summary.json"), summary)
        for row in summary["rows"]:
            self.log("bench: " + format_row(row))
        return "done"

    # -- delivery
