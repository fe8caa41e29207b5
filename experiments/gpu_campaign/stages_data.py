"""The campaign's first stages: setup, model, data, release (methods of ``driver.Campaign``)."""

from __future__ import annotations

import glob
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import time

from experiments.gpu_campaign import common
from experiments.gpu_campaign.common import (ASSET_FILES, CPU_RELEASE, CampaignError, IMPORTS, MODEL, MODEL_PACKAGE,
                                             RELEASE_NAME, TokenEstimate, dist_name, read_json, sha256_file,
                                             write_json)


class DataStages:
    """setup, model, data and release; mixed into ``driver.Campaign``, whose helpers they call."""

    def st_setup(self) -> str:
        b = self.bundle_meta()
        if b is None:
            raise CampaignError("no bundle: call 1 must carry .gpu_bundle/call1 (python -m experiments.gpu_campaign "
                                "bundle builds it here)")
        call1 = os.path.join(self.bundle_dir, "call1")
        if not os.path.isdir(call1):
            raise CampaignError("setup needs .gpu_bundle/call1, which is not here: this is a fresh machine (the "
                                "warm one was given back) or the calls came out of order; start again with call 1")
        # wheels: only those the image lacks or holds at another version
        installed = self._versions()
        todo = [w for w in sorted(glob.glob(os.path.join(call1, "wheels", "*.whl")))
                if installed.get(dist_name(w)[0]) != dist_name(w)[1]]
        if todo:
            self.log("setup: installing " + ", ".join(os.path.basename(w) for w in todo))
            r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                                "--no-compile", "--no-cache-dir", "--upgrade", "--target", self.path("site"), *todo],
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise CampaignError(f"pip install failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        # asset shims: MT-Bench / HumanEval where confu_jax.assets looks
        for name, (package, rel) in ASSET_FILES.items():
            src = os.path.join(call1, "assets", os.path.basename(rel))
            dst = self.path("assets", package, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            open(self.path("assets", package, "__init__.py"), "a").close()
            shutil.copyfile(src, dst)
            if sha256_file(dst) != b["assets"][name]["sha256"]:
                raise CampaignError(f"{src}: sha256 differs from the bundle's")
        # prompts
        src = os.path.join(call1, b["prompts"]["file"])
        raw = lzma.decompress(open(src, "rb").read())
        if hashlib.sha256(raw).hexdigest() != b["prompts"]["sha256_jsonl"]:
            raise CampaignError(f"{src}: decompressed prompts differ from the bundle's (sha256)")
        os.makedirs(self.path("prompts"), exist_ok=True)
        with open(self.path("prompts", "sharegpt_prompts.jsonl"), "wb") as f:
            f.write(raw)
        # the model parts this call carries (call 1's part now, before its folder can be replaced)
        self._collect_parts(b)
        # check the stack: imports and devices, with the installed wheels
        probe = ("import importlib, json, jax\nv = {}\nfor m in %r:\n    mod = importlib.import_module(m)\n"
                 "    v[m] = getattr(mod, '__version__', '?')\n"
                 "d = jax.devices()\nprint(json.dumps({'versions': v, 'backend': jax.default_backend(), "
                 "'devices': [str(x) for x in d], 'kind': getattr(d[0], 'device_kind', '?')}))") % (IMPORTS,)
        r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=self.env(), cwd=common.ROOT)
        if r.returncode != 0:
            raise CampaignError(f"the Python stack does not import:\n{r.stderr[-3000:]}")
        info = json.loads(r.stdout.strip().splitlines()[-1])
        info["installed_wheels"] = [os.path.basename(w) for w in todo]
        self.stage("setup")["info"] = info
        self.log(f"setup: {info['backend']} {info['kind']} x{len(info['devices'])}; " +
                 ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
        return "done"

    def _versions(self) -> dict:
        code = ("import importlib.metadata as m, json\n"
                "print(json.dumps({d.metadata['Name'].lower().replace('_', '-'): d.version for d in m.distributions()}))")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=self.env(), cwd=common.ROOT)
        return json.loads(r.stdout) if r.returncode == 0 else {}

    def _collect_parts(self, b: dict) -> list[str]:
        os.makedirs(self.path("model_parts"), exist_ok=True)
        have = []
        for p in b["model"]["parts"]:
            dst = self.path("model_parts", p["file"])
            if not (os.path.isfile(dst) and os.path.getsize(dst) == p["bytes"]):
                src = os.path.join(self.bundle_dir, p["call"], p["file"])
                if os.path.isfile(src):
                    if sha256_file(src) != p["sha256"]:
                        raise CampaignError(f"{src}: sha256 differs from the bundle's (a torn transfer?)")
                    shutil.copyfile(src, dst + ".tmp")
                    os.replace(dst + ".tmp", dst)
                    self.log(f"model: received {p['file']} ({p['bytes'] / 2**20:.1f} MiB) from {p['call']}")
            if os.path.isfile(dst):
                have.append(p["file"])
        return have

    def st_model(self) -> str:
        b = self.bundle_meta()
        m = b["model"]
        target = self.path("assets", MODEL_PACKAGE, m["file"])
        if not os.path.isfile(target):
            have = self._collect_parts(b)
            missing = [p for p in m["parts"] if p["file"] not in have]
            if missing:
                calls = sorted({p["call"] for p in missing}, key=lambda c: int(c[4:]))
                self.stage("model")["info"] = {"have": have, "next_call": calls[0]}
                self.log(f"model: have {have or 'no part'}; the next call must carry {calls} "
                         f"(.gpu_bundle/{calls[0]})")
                return "wait"
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(self.path("assets", MODEL_PACKAGE, "__init__.py"), "a").close()
            with open(target + ".tmp", "wb") as out:
                for p in m["parts"]:
                    with open(self.path("model_parts", p["file"]), "rb") as f:
                        shutil.copyfileobj(f, out)
            if sha256_file(target + ".tmp") != m["sha256"]:
                os.remove(target + ".tmp")
                raise CampaignError("model: the reassembled GGUF's sha256 differs from the bundle's")
            os.replace(target + ".tmp", target)
            self.log(f"model: reassembled {m['file']} ({m['bytes'] / 2**20:.1f} MiB), sha256 checked")
        # the loader gives the same f32 weights as on the machine that bundled it
        rc, _ = self.run_cmd("model_check", [sys.executable, "-m", "experiments.gpu_campaign", "step", "digest",
                                             "--out", self.path("model_digest.json")], timeout=max(30, self.left()),
                             cpu=True)
        got = read_json(self.path("model_digest.json"), {})
        if rc != 0 or got.get("params_sha256") != m["digest"]["params_sha256"]:
            raise CampaignError(f"model: load_model({MODEL!r}) here differs from the bundle's: {got} vs {m['digest']}")
        self.stage("model")["info"] = {"params_sha256": got["params_sha256"], "fingerprint": got["fingerprint"]}
        self.log("model: load_model gives the bundled weights bit for bit (sha256 of every dequantised tensor)")
        shutil.rmtree(self.path("model_parts"), ignore_errors=True)
        return "done"

    def data_passes(self) -> list[tuple[str, float, str]]:
        """(key, temperature, release name) of each generation pass (none at gen_passes = 0: the
        campaign trains on the repository's releases)."""
        if self.scale.gen_passes < 1:
            return []
        passes = [("greedy", 0.0, RELEASE_NAME)]
        if self.scale.gen_passes > 1:
            passes.append(("sampled", float(self.scale.gen_sampled_temperature), RELEASE_NAME + "_sampled"))
        return passes

    def released_elsewhere(self) -> list[str]:
        """Releases in the repository whose conversations generation skips: the CPU release and
        every earlier campaign's release of a pass this campaign runs."""
        repo = self.scale.repo_releases
        names = [CPU_RELEASE] + ([os.path.join(repo, name) for _, _, name in self.data_passes()] if repo else [])
        return [n for n in names if os.path.isfile(os.path.join(common.ROOT, n, "manifest.json"))]

    def st_data(self) -> str:
        s, st = self.scale, self.stage("data")
        os.makedirs(self.path("data"), exist_ok=True)
        passes = st.setdefault("passes", {})
        estimates = {key: TokenEstimate(self.path("data", f"{key}.jsonl")) for key, _, _ in self.data_passes()}
        total = lambda: sum(e.update() for e in estimates.values())  # noqa: E731
        for key, temperature, _ in self.data_passes():
            p = passes.setdefault(key, {"status": "pending", "gen_seconds": 0.0})
            if p["status"] in ("done", "skipped"):
                continue
            box = s.data_s - st.get("gen_seconds", 0.0)
            if box <= 5 or total() >= s.gen_target_tokens:
                p["status"] = "skipped"
                continue
            output = self.path("data", f"{key}.jsonl")
            cmd = [sys.executable, "-m", "launch.generate_data", "--output", output,
                   "--input", self.path("prompts", "sharegpt_prompts.jsonl"), "--max_turns", "0",
                   "--batch_size", s.gen_batch, "--max_new_tokens", s.gen_max_new,
                   "--max_prompt_len", s.gen_max_prompt, "--temperature", temperature, "--top_p", "1",
                   "--steps_per_sync", s.gen_steps_per_sync]
            if s.gen_dtype:
                cmd += ["--dtype", s.gen_dtype]
            cmd += ["--fill_rows", s.gen_fill_rows]
            skip = self.released_elsewhere()
            if skip:
                cmd += ["--release", ",".join(skip)]
            budget = min(box, self.left())
            if budget < 30:
                return "later"
            last = {"t": time.time()}

            def poll(_proc):
                if time.time() - last["t"] < 20:
                    return False
                last["t"] = time.time()
                return total() >= s.gen_target_tokens

            t = time.time()
            rc, stopped = self.run_cmd(f"data_{key}", cmd, budget, on_poll=poll)
            dt = time.time() - t
            st["gen_seconds"] = st.get("gen_seconds", 0.0) + dt
            p["gen_seconds"] += dt
            tokens = st["estimated_answer_tokens"] = total()
            p["estimated_answer_tokens"] = estimates[key].update()
            self.log(f"data: {key} (T={temperature:g}) ~{p['estimated_answer_tokens'] / 1e6:.2f} M answer tokens; "
                     f"all passes ~{tokens / 1e6:.2f} M (estimated from characters) in {st['gen_seconds']:.0f} s")
            self.save()
            if rc != 0 and not stopped:
                raise CampaignError(f"data: launch.generate_data failed (logs/data_{key}.log)")
            if not stopped:
                p.update(status="done", ended_by="all prompts done")
                continue
            if tokens >= s.gen_target_tokens or st["gen_seconds"] >= s.data_s - 5:
                p.update(status="done", ended_by="token target" if tokens >= s.gen_target_tokens else "time box")
                continue
            return "later"  # the call's time ran out: the pass resumes next call
        return "done"

    def st_release(self) -> str:
        b = self.bundle_meta() or {}
        members, infos = [], {}
        if not self.data_passes():
            self.log("release: no generation pass (gen_passes = 0); training uses the repository's releases")
            return "done"
        for key, _, name in self.data_passes():
            src = self.path("data", f"{key}.jsonl")
            if not os.path.isfile(src) or os.path.getsize(src) == 0:
                continue
            rel = self.path("release", name)
            repo_copy = os.path.join(common.ROOT, self.scale.repo_releases, name) if self.scale.repo_releases else ""
            if repo_copy and not os.path.isdir(rel) and os.path.isfile(os.path.join(repo_copy, "manifest.json")):
                # an earlier campaign's release of this recipe: new parts continue it (append-only),
                # so the folder that comes back replaces the repository's copy
                shutil.copytree(repo_copy, rel)
                self.log(f"release: continuing the repository's {self.scale.repo_releases}/{name}")
            p = self.stage("data")["passes"].get(key, {})
            rc, _ = self.run_cmd(f"release_{key}", [
                sys.executable, "-m", "experiments.gpu_campaign", "step", "release", "--input", src, "--release", rel,
                "--release_name", name, "--level", self.scale.release_level, "--commit", b.get("git_commit") or "",
                "--gen_seconds", p.get("gen_seconds", 0.0), "--summary", self.path("data", f"{key}_summary.json")],
                timeout=max(60, self.left()), cpu=True)
            if rc != 0:
                raise CampaignError(f"release: packing {key} failed (logs/release_{key}.log)")
            info = infos[name] = read_json(self.path("data", f"{key}_summary.json"), {})
            members.append((rel, f"release/{name}"))
            self.log(f"release: {name}: {info.get('conversations')} conversations, {info.get('answer_tokens')} answer "
                     f"tokens in {info.get('n_parts')} parts ({info.get('bytes', 0) / 1e6:.1f} MB), "
                     f"{info.get('answer_tokens_per_s')} answer tokens/s of generation")
        if not infos:
            raise CampaignError("release: the data stage generated nothing")
        summary = {"releases": infos, "answer_tokens": sum(i["answer_tokens"] for i in infos.values()),
                   "conversations": sum(i["conversations"] for i in infos.values())}
        write_json(self.path("data_summary.json"), summary)
        self.stage("release")["info"] = summary
        self.log(f"release: {summary['answer_tokens'] / 1e6:.2f} M answer tokens in all")
        self.add_artifact("data_release", members)
        return "done"

    # training
