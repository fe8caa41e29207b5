"""results.json, the markdown table and the τ figure carry exactly the numbers they were given."""

import json
import math
import os
import subprocess

import numpy as np
import pytest

from confu_jax.bench import report
from confu_jax.bench.metrics import GenerationLog as G, summarize

BASE = [G.autoregressive(1, "writing", 10, 2.0), G.autoregressive(2, "coding", 10, 2.5),
        G.autoregressive(3, "math_reasoning", 10, 2.2)]
EAGLE = [G(1, "writing", (3, 3, 3), 10, 0.9), G(2, "coding", (4, 5), 10, 0.7),
         G(3, "math_reasoning", (2, 2, 2, 3), 10, 1.1)]
CONFU = [G(1, "writing", (4, 5), 10, 0.6), G(2, "coding", (6, 3), 10, 0.55),
         G(3, "math_reasoning", (3, 3, 3), 10, 0.8)]


def _results():
    return [summarize("ar", BASE, BASE),
            summarize("eagle3", EAGLE, BASE, nodes=30, temperature=0.0, depth=5),
            summarize("confu", CONFU, BASE, nodes=30, temperature=0.7, depth=5, setting={"top_p": 1.0})]


def test_write_results_has_required_fields_and_values(tmp_path):
    results = _results()
    env = report.collect_environment(["launch/decode_bench.py", "--method", "ar"])
    out = tmp_path / "sub" / "results.json"
    report.write_results(out, results, env)
    doc = json.loads(out.read_text())
    e = doc["environment"]
    for k in report.REQUIRED_ENV_FIELDS:
        assert k in e
    # a commit of this repository (HEAD may move meanwhile: other work commits concurrently)
    assert len(e["git_commit"]) == 40
    assert subprocess.run(["git", "merge-base", "--is-ancestor", e["git_commit"], "HEAD"]).returncode == 0
    assert e["command_line"] == ["launch/decode_bench.py", "--method", "ar"]
    assert isinstance(e["cpu_count"], int) and e["devices"]
    cpuinfo = "/proc/cpuinfo"  # this run's processor, as cpu_description reads it (Linux; else unnamed)
    text = open(cpuinfo).read() if os.path.exists(cpuinfo) else ""
    assert {k: e[k] for k in ("cpu_model", "cpu_isa")} == report.cpu_description(text)
    assert [r["method"] for r in doc["results"]] == ["ar", "eagle3", "confu"]
    for row, res in zip(doc["results"], results):
        assert (row["nodes"], row["temperature"]) == (res.nodes, res.temperature)
        assert row["tau"] == res.tau and row["tokens_per_s"] == res.tokens_per_s
        assert row["speedup"] == res.speedup
        assert set(row["per_category"]) == set(res.per_category)
        for name, cat in row["per_category"].items():
            assert cat["tau"] == res.per_category[name].tau
            assert cat["speedup"] == res.per_category[name].speedup
    confu = doc["results"][2]
    assert confu["tau"] == pytest.approx(27 / 7)  # (4+5+6+3+3+3+3) / 7 passes
    assert confu["setting"] == {"top_p": 1.0}
    assert confu["accept_length_histogram"] == [0, 0, 0, 4, 1, 1, 1]
    assert report.load_results(out) == doc["results"]


def test_cpu_description_names_model_and_vector_extensions():
    # two processors listed: the first one's lines are read; flags in /proc/cpuinfo's order
    x86 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14\n"
           "flags\t\t: fpu sse4_2 avx avx2 avx512f avx512_bf16 sha_ni\n\n"
           "processor\t: 1\nmodel name\t: other\nflags\t\t: fpu\n")
    assert report.cpu_description(x86) == {"cpu_model": "AMD EPYC 9R14",
                                           "cpu_isa": ["avx512_bf16", "avx512f", "avx2", "avx", "sse4_2"]}
    # a machine with avx2 but no avx512 (the slower kind of host this project has been timed on)
    assert report.cpu_description("model name : AMD EPYC\nflags : sse4_2 avx avx2 fma\n")["cpu_isa"] == \
        ["avx2", "avx", "sse4_2"]
    arm = "processor : 0\nFeatures : fp asimd sve atomics\nCPU part : 0xd40\n"
    assert report.cpu_description(arm) == {"cpu_model": None, "cpu_isa": ["asimd", "sve"]}
    assert report.cpu_description("") == {"cpu_model": None, "cpu_isa": None}


def test_write_results_rejects_incomplete_input(tmp_path):
    env = report.collect_environment([])
    with pytest.raises(ValueError, match=r"missing field\(s\) \['speedup'\]"):
        report.write_results(tmp_path / "r.json", [{"method": "x", "nodes": None, "temperature": 0.0,
                                                    "tau": 1.0, "tokens_per_s": 1.0,
                                                    "per_category": {}}], env)
    with pytest.raises(ValueError, match="environment lacks"):
        report.write_results(tmp_path / "r.json", _results(), {"jax_version": "0"})
    assert not (tmp_path / "r.json").exists()


def _parse_table(md):
    lines = [l for l in md.strip().splitlines()]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert set(lines[1].replace("|", "")) == {"-"}
    rows = [[c.strip() for c in l.strip("|").split("|")] for l in lines[2:]]
    return header, rows


def test_markdown_table_numbers_equal_inputs():
    results = _results()
    header, rows = _parse_table(report.markdown_table(results))
    # the paper's column order: WRIT, CODE, M/R, then the pooled AVG
    assert header == ["Method", "Nodes", "T", "WRIT τ", "WRIT SR", "CODE τ", "CODE SR",
                      "M/R τ", "M/R SR", "AVG τ", "AVG SR"]
    assert [r[:3] for r in rows] == [["ar", "–", "0"], ["eagle3", "30", "0"], ["confu", "30", "0.7"]]
    for row, res in zip(rows, results):
        for j, name in enumerate(["writing", "coding", "math_reasoning"]):
            assert float(row[3 + 2 * j]) == round(res.per_category[name].tau, 2)
            assert float(row[4 + 2 * j]) == round(res.per_category[name].speedup, 2)
        assert float(row[-2]) == round(res.tau, 2) and float(row[-1]) == round(res.speedup, 2)
    # spot check one by hand: ConFu writing τ = 9/2, SR = (10/0.6)/(10/2.0) = 3.33
    assert rows[2][3:5] == ["4.50", "3.33"]


def test_markdown_table_marks_missing_categories():
    only_writing = summarize("eagle3", EAGLE[:1], BASE[:1], nodes=60)
    header, rows = _parse_table(report.markdown_table([_results()[2], only_writing]))
    assert rows[1][header.index("CODE τ")] == "–"
    assert rows[1][header.index("WRIT τ")] == f"{only_writing.per_category['writing'].tau:.2f}"


def test_plot_tau_writes_png_with_one_bar_per_method_and_category(tmp_path):
    results = _results()
    png = tmp_path / "figs" / "tau.png"
    fig = report.plot_tau(results, png)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image
    img = matplotlib.image.imread(str(png))
    assert img.shape[0] > 100 and img.shape[1] > 100
    assert np.ptp(img[..., :3]) > 0  # not a blank canvas
    ax = fig.axes[0]
    heights = [p.get_height() for p in ax.patches]
    expected = [v for r in results for v in
                [r.per_category[c].tau for c in ("writing", "coding", "math_reasoning")] + [r.tau]]
    assert heights == pytest.approx(expected)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["WRIT", "CODE", "M/R", "AVG"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "ar, T=0", "eagle3, 30 nodes, T=0", "confu, 30 nodes, T=0.7"]


def test_nan_becomes_null_in_json(tmp_path):
    r = summarize("x", [G(1, "qa", (), 1, 1.0)], [G.autoregressive(1, "qa", 1, 1.0)])
    assert math.isnan(r.tau)
    doc = report.write_results(tmp_path / "r.json", [r], report.collect_environment([]))
    assert doc["results"][0]["tau"] is None
    assert json.loads((tmp_path / "r.json").read_text())["results"][0]["per_category"]["qa"]["tau"] is None
    assert "–" in report.markdown_table([r])
