"""The benchmark code runs end to end on a 1-layer tiny model with one repeat (`run_all.py
--smoke`): every engine (tonp invariant, tonp torch mode, transformers), the roofline, the targets
and the report files. No timing is asserted: this only guards against the benchmarks rotting."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

# The benchmarks are scripts that import their siblings (benchlib, roofline, model_bench).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.timeout(120)
def test_run_all_smoke_writes_report(tmp_path):
    import run_all
    data = run_all.main(["--smoke", "--dtypes", "fp32", "--out", str(tmp_path)])
    md = (tmp_path / "latest_smoke.md").read_text()
    assert "## Targets" in md and "## Model: tiny-1L" in md
    # every report names the CPU (model name, family and model) and the kernel table it ran
    import tonp_kernels as tk
    assert f"kernel table **{tk.isa()}**" in md and data["meta"]["isa"] == tk.isa()
    assert "family " in data["meta"]["cpu"] or not Path("/proc/cpuinfo").exists()
    res = data["cases"][0]["results"]["fp32"]
    assert set(res) == {"tonp invariant", "tonp torch", "transformers"}
    for engine in res.values():
        assert set(engine) == {"decode_b1", "decode_b16", "prefill", "train"}
        assert all(m["tok_s"] > 0 for m in engine.values())
        # decode bounds use the bandwidth probed between that measurement's repeats
        assert all(engine[d]["read_GBs"] > 0 for d in ("decode_b1", "decode_b16"))
    assert "(memory, " in md and " GB/s) |" in md
    assert {t["metric"] for t in data["targets"]} == {"decode_b1", "decode_b16", "train"}
    json.loads((tmp_path / "latest_smoke.json").read_text())


def test_roofline_counts_active_weights():
    """Batch-1 decode bytes: attention + router + top-k experts per layer, plus the LM head."""
    import roofline
    from tonp_models import Qwen3MoeConfig
    c = Qwen3MoeConfig.preset("qwen3_30b_a3b", num_hidden_layers=2, vocab_size=16384)
    H, D = 2048, 128
    attn = H * 32 * D * 2 + H * 4 * D * 2 + 2 * D + 2 * H
    layer = attn + 128 * H + 8 * 3 * 768 * H
    assert roofline.active_weight_bytes(c, 2) == 2 * (2 * layer + H * (1 + 16384 + 1))
    assert roofline.expected_distinct_experts(c, 16) < 128
    assert roofline.flops_per_token(c, 10, training=True) == \
        3 * roofline.flops_per_token(c, 10)


def test_decode_step_bound_adds_each_op_class_at_its_own_limit():
    """The step's roofline is the sum over op classes of max(bytes / bandwidth, FLOPs / rate):
    its bytes are the whole step's (decode_bytes), and at batch 128 (dense linears compute-bound,
    experts memory-bound) it exceeds the max of the totals; measured distinct experts replace the
    uniform expectation."""
    import roofline
    from tonp_models import Qwen3MoeConfig
    c = Qwen3MoeConfig.preset("qwen3_30b_a3b", num_hidden_layers=2, vocab_size=16384)
    for batch in (1, 16, 128):
        b = roofline.decode_step_bound(c, 4, batch, 80.0, read_GBs=30.0, gemm_GFLOPs=190.0)
        nbytes = sum(p["bytes"] for p in b["parts"].values())
        assert nbytes == pytest.approx(roofline.decode_bytes(c, 4, batch, 80.0), rel=1e-12)
        assert b["bound_s"] == pytest.approx(sum(max(p["mem_s"], p["compute_s"])
                                                 for p in b["parts"].values()))
        assert b["bound_s"] >= b["coarse_bound_s"]
    b1 = roofline.decode_step_bound(c, 4, 1, 80.0, read_GBs=30.0, gemm_GFLOPs=190.0)
    assert b1["kind"] == "memory" and b1["bound_s"] == pytest.approx(b1["coarse_bound_s"])
    b = roofline.decode_step_bound(c, 4, 128, 80.0, read_GBs=30.0, gemm_GFLOPs=190.0)
    assert b["kind"] == "mixed" and b["parts"]["dense"]["kind"] == "compute"
    assert b["parts"]["experts"]["kind"] == "memory" and b["bound_s"] > 1.2 * b["coarse_bound_s"]
    few = roofline.decode_step_bound(c, 4, 128, 80.0, 30.0, 190.0, distinct_experts=64)
    assert few["parts"]["experts"]["bytes"] == pytest.approx(b["parts"]["experts"]["bytes"] * 64
                                                            / b["distinct_experts"])


def test_kernel_benchmark_samples_candidates_in_turn():
    """benchmarks/kernel_bench.py times the baseline and tonp round by round (a, b, c, a, b, c, ...),
    so a drifting load falls on all of them alike. Checks the order and count of the calls, not
    any timing."""
    # Loaded under its own name: a module called `kernels` in sys.modules would shadow Hugging
    # Face's `kernels` package, which transformers probes.
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_bench.py"
    spec = importlib.util.spec_from_file_location("tonp_bench_kernels", path)
    kbench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kbench)
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("torch_fp32", "tonp_fp32", "tonp_bf16")}
    out = kbench.timeit_interleaved(fns, repeat=4, max_total_s=10.0)
    assert set(out) == set(fns) and all(t > 0 for t in out.values())
    names = list(fns)
    rounds = len(calls) // len(names)
    assert rounds >= 1 + 4 and len(calls) == rounds * len(names)  # the warm-up round, then >= repeat
    assert calls == names * rounds


@pytest.mark.timeout(120)
def test_train_bench_quick_writes_its_targets(tmp_path):
    """benchmarks/train_bench.py (the training targets) runs on the tiny model: every contender
    timed, the ratios computed, the ISA and the eight targets (the backward GEMMs against the
    stock ones among them) in the report."""
    import train_bench
    assert train_bench.main(["--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "train_quick.json").read_text())
    assert data["isa"] in ("avx512bf16", "avx2", "portable")
    for dt in ("fp32", "bf16"):
        gemms = {"fp32 GEMM", "tonp fp32 GEMM"} | ({"bf16 GEMM", "tonp bf16 GEMM"} if dt == "bf16" else set())
        assert set(data[dt]["seconds"]) == {f"{m} {w}" for m in ("invariant", "torch")
                                            for w in ("forward", "train", "prefill")} | gemms
        assert all(s > 0 for s in data[dt]["seconds"].values())
        assert set(data[dt]["backward_gemm_vs_stock"]) == ({"fp32", "bf16"} if dt == "bf16" else {"fp32"})
    md = (tmp_path / "train_quick.md").read_text()
    assert md.count("| met |") + md.count("| **NOT met** |") == 8 and data["isa"] in md
    assert "backward GEMM >= 0.7x MKL's fp32 GEMM" in md


@pytest.mark.timeout(180)
def test_decode_bench_smoke_reports_bound_overhead_and_bits(tmp_path):
    """benchmarks/decode_bench.py --smoke: every batch row has its bound, the engine's overhead,
    the prefill's rate, tonp's batch-1 bits and the step's time by op class; vLLM is reported
    absent unless asked for."""
    import decode_bench
    data = decode_bench.main(["--smoke", "--dtypes", "fp32", "--out", str(tmp_path)])
    rows = data["results"]
    assert [r["batch"] for r in rows] == [1, 4]
    for r in rows:
        assert r["tonp_batch_invariant"] is True
        assert r["bound"]["kind"] in ("memory", "compute", "mixed") and 0 < r["fraction_of_bound"]
        assert r["fraction_of_coarse_bound"] <= r["fraction_of_bound"]
        assert 1 <= r["bound"]["distinct_experts"] <= data["config"]["num_experts"]
        assert len(r["read_GBs_probes"]) == 1 and r["read_GBs_round"] == r["read_GBs_probes"][0]
        assert len(r["read_GBs_round"]) == 2 and r["read_GBs"] == max(r["read_GBs_round"])  # before, after
        assert r["tonp_overhead_s"] >= 0 and "vllm_e2e_tok_s" not in r
        assert r["tonp_prefill_tok_s"] > 0 and "vllm_prefill_tok_s" not in r
        brk = r["breakdown"]  # the step op class by op class, each against its own bound
        # The profiler saw every class's ops. (The tiny model's ops take microseconds, so a
        # class's time a step, a difference of two profiled generates, may come out at or below
        # zero: only its presence is checked.)
        assert all(brk["profiled_s"][c] > 0 for c in ("experts", "dense", "attention"))
        assert set(brk["classes_s"]) == {"experts", "dense", "attention", "rest"}
        assert all(math.isfinite(v) for v in brk["classes_s"].values()) and brk["step_s"] > 0
        assert set(brk["bound_s"]) == {"experts", "dense", "attention", "other"} and len(brk["read_GBs"]) == 2
    md = (tmp_path / "decode_smoke.md").read_text()
    import tonp_kernels as tk
    assert f"kernel table **{tk.isa()}**" in md and "vLLM:" in md
    assert "## Where a decode step's time goes" in md and "| fp32 | 4 |" in md.split("time goes")[1]


def test_decode_bench_takes_its_batch_1_reference_from_a_batch_1_run(tmp_path, monkeypatch):
    """Without batch 1 in --batches, prompt 0's reference is still a batch-1 generate (it was the
    first batch measured, so batch 4 was compared with itself); the bits are compared against it."""
    import decode_bench
    calls, real = [], decode_bench.tonp_run

    def spy(model, prompts, new, *a, **kw):
        calls.append((len(prompts), new))
        return real(model, prompts, new, *a, **kw)
    monkeypatch.setattr(decode_bench, "tonp_run", spy)
    data = decode_bench.main(["--smoke", "--dtypes", "fp32", "--batches", "4", "--out", str(tmp_path)])
    assert [r["batch"] for r in data["results"]] == [4]
    assert calls[0] == (1, 4)                      # prompt 0 alone, the full 4 new tokens, first
    assert data["results"][0]["tonp_batch_invariant"] is True


@pytest.mark.timeout(120)
def test_weight_groups_bench_smoke_alternates_both_variants_with_the_same_bits(tmp_path):
    """benchmarks/weight_groups_bench.py --smoke: every round runs the engine with and without
    the experts' weight groups, their logprobs are bitwise equal, groups are held for the dtypes
    the table reads (AVX512-BF16 both, AVX2 fp32, portable none), and the report names the
    kernel table."""
    import weight_groups_bench
    import tonp_kernels as tk
    data = weight_groups_bench.main(["--smoke", "--out", str(tmp_path)])
    assert [(r["dtype"], r["batch"]) for r in data["results"]] == [
        ("bf16", 1), ("bf16", 4), ("fp32", 1), ("fp32", 4)]
    for r in data["results"]:
        assert r["same_bits"] is True and len(r["rounds"]) == 1
        assert all(x["ratio"] > 0 and len(x["probes"]) == 4 for x in r["rounds"])
    reads = {"avx512bf16": {"bf16", "fp32"}, "avx2": {"fp32"}}.get(tk.isa(), set())
    assert {d: v > 0 for d, v in data["held_bytes"].items()} == \
        {d: d in reads for d in data["held_bytes"]}, "groups held where the table reads them"
    md = (tmp_path / "weight_groups_smoke.md").read_text()
    assert f"kernel table **{tk.isa()}**" in md and "| bf16 | 1 |" in md and "| fp32 | 4 |" in md


def test_decode_bench_marks_a_ratio_whose_rounds_saw_different_buses():
    """A tonp / vLLM ratio is marked when the better probe around tonp's reported round and the
    one around vLLM's differ by more than 20% (this VM's bus moves between about 35 and 60 GB/s):
    such a ratio measures the bus as much as the engines. No peer: no mark."""
    import decode_bench
    mark = decode_bench.bus_mark
    assert mark({"read_GBs_round": [36.0, 35.0]}) == ""
    assert mark({"read_GBs_round": [36.0, 35.0], "vllm_read_GBs_round": [35.0, 54.0]}) == "*"
    assert mark({"read_GBs_round": [55.0, 54.0], "vllm_read_GBs_round": [34.0, 36.0]}) == "*"
    assert mark({"read_GBs_round": [55.0, 56.0], "vllm_read_GBs_round": [53.0, 54.0]}) == ""
    assert mark({"read_GBs_round": [40.0, 30.0], "vllm_read_GBs_round": [47.0, 20.0]}) == ""  # 47 < 1.2 * 40


def test_decode_bench_same_bus_ratio_takes_only_rounds_on_one_bus():
    """The one-bus ratio: vLLM's wall time over tonp's in each round whose two back-to-back runs
    probed within 20% of each other, the median of those; None when no round did."""
    import decode_bench
    ratio = decode_bench.same_bus_ratio

    def rnd(t, tp, v, vp):
        return {"tonp_wall_s": t, "tonp_probes": tp, "vllm_wall_s": v, "vllm_probes": vp}
    fast, slow = [60.0, 58.0], [36.0, 35.0]
    assert ratio([]) is None
    assert ratio([rnd(1.0, slow, 2.0, fast)]) is None                      # across buses only
    assert ratio([rnd(1.0, slow, 0.9, slow), rnd(0.6, fast, 1.2, slow)]) == pytest.approx(0.9)
    assert ratio([rnd(1.0, slow, 0.9, slow), rnd(0.5, fast, 0.6, fast)]) == pytest.approx(1.05)
    assert ratio([rnd(1.0, slow, 0.9, slow), rnd(0.5, fast, 0.6, fast),
                  rnd(1.0, slow, 1.5, slow)]) == pytest.approx(1.2)           # the median
    with pytest.raises(SystemExit):                                          # no round to report
        decode_bench.parse_args(["--rounds", "0"])


@pytest.mark.timeout(300)
def test_amx_bench_runs_where_there_is_amx(tmp_path, capsys):
    """benchmarks/amx_bench.py with a few samples and one round: on an AMX machine the measured
    model agrees with every output and every contender is timed, the backward GEMM's too; with
    AVX-512F only, the FMA contenders; with neither it says so and writes nothing."""
    import amx_bench
    import tonp_kernels.amx as amx
    assert amx_bench.main(["--samples", "256", "--repeat", "1", "--max-s", "0.1", "--out", str(tmp_path)]) == 0
    if not amx.available() and not amx_bench._has_avx512f():
        assert "nothing to measure" in capsys.readouterr().out and not list(tmp_path.iterdir())
        return
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["amx.json", "amx.md"]
    data = json.loads((tmp_path / "amx.json").read_text())
    contenders = {r["contender"] for r in data["throughput"]}
    assert {"stock bf16 matmul", "AVX-512 FMA block chains, pre-packed"} <= contenders
    if amx.available():
        assert data["numerics"] and all(r["measured model"] == 1.0 for r in data["numerics"])
        assert "AMX block chains, pre-packed" in contenders
        assert "tdpbf16ps" in (tmp_path / "amx.md").read_text()
        assert {r["contender"] for r in data["backward_gemm"]} == {"stock bf16 matmul", "tonp dx", "tonp dW"}
    else:
        assert not data["numerics"] and "AMX block chains" not in contenders and not data["backward_gemm"]


@pytest.mark.timeout(180)
def test_amx_decode_runs_where_there_is_amx(tmp_path, capsys):
    """benchmarks/amx_decode.py --smoke: on an AMX machine every arm is timed, the v2 arm runs its
    linears on the prototype, and the two version-1 arms give the same bits; elsewhere it says so
    and writes nothing."""
    import amx_decode
    import tonp_kernels.amx as amx
    assert amx_decode.main(["--smoke", "--out", str(tmp_path)]) == 0
    if not amx.available():
        assert "nothing to measure" in capsys.readouterr().out and not list(tmp_path.iterdir())
        return
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["amx_decode_smoke.json", "amx_decode_smoke.md"]
    data = json.loads((tmp_path / "amx_decode_smoke.json").read_text())
    arms = set(amx_decode.ARMS)
    assert [set(e["ms"]) for e in data["experts"]] == [arms] and [set(d["step_ms"]) for d in data["decode"]] == [arms]
    d = data["decode"][0]
    assert d["v1_arms_same_tokens"] and d["v1_arms_same_logprob_bits"] and d["v2_linears_in_prefill"] > 0
    assert not hasattr(__import__("tonp_kernels").linear, "__self__")  # tk.linear given back


def test_a_run_never_overwrites_another_machines_record(tmp_path):
    """benchlib.record_stem: kernel_bench and decode_bench write `stem` unless its json holds
    another machine's run (another CPU model or kernel table), then `stem_<machine>`, then that
    with the CPU's family and model."""
    from benchlib import machine_slug, record_stem, write_record
    intel = {"cpu": "Intel(R) Xeon(R) Processor", "isa": "avx512bf16"}
    zen4 = {"cpu": "AMD EPYC (family 25, model 17)", "isa": "avx512bf16"}
    zen4_avx2 = {"cpu": "AMD EPYC (family 25, model 17)", "isa": "avx2"}
    zen5 = {"cpu": "AMD EPYC (family 26, model 2)", "isa": "avx512bf16"}
    assert [machine_slug(m) for m in (intel, zen4, zen4_avx2)] == ["intel_xeon", "amd_epyc", "amd_epyc_avx2"]
    assert record_stem(tmp_path, "decode", zen4) == "decode"                  # nothing there yet
    write_record(tmp_path, "decode", "intel\n", {"meta": intel})
    assert record_stem(tmp_path, "decode", intel) == "decode"                 # its own record
    assert record_stem(tmp_path, "decode", zen4) == "decode_amd_epyc"
    assert record_stem(tmp_path, "decode", zen4_avx2) == "decode_amd_epyc_avx2"
    write_record(tmp_path, "decode", "zen4\n", {"meta": zen4})
    assert (tmp_path / "decode.md").read_text() == "intel\n"                  # kept
    assert json.loads((tmp_path / "decode_amd_epyc.json").read_text())["meta"] == zen4
    assert record_stem(tmp_path, "decode", zen5) == "decode_amd_epyc_f26m2"
    write_record(tmp_path, "decode", "zen4 again\n", {"meta": zen4})
    assert (tmp_path / "decode_amd_epyc.md").read_text() == "zen4 again\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "decode.json", "decode.md", "decode_amd_epyc.json", "decode_amd_epyc.md"]


@pytest.mark.timeout(180)
def test_packed_experts_groups_give_the_in_place_bits(capsys):
    """benchmarks/packed_experts.py --smoke: linear_panel given the fp32 weight groups (packed by
    the harness in the lane tiles' order) gives the in-place bits byte for byte (the bench raises
    otherwise) at one row an expert (against the one-row dot tiles) and eight (against the 4 x 4
    dot tiles); without AVX-512 it says so and measures nothing."""
    import packed_experts
    res = packed_experts.main(["--smoke"])
    out = capsys.readouterr().out
    if not res:
        assert "no AVX-512" in out
        return
    assert set(res) == {(1, 2048, 1536), (8, 768, 2048)}
    for samples in res.values():
        assert {c: len(v) for c, v in samples.items()} == {"inplace": 1, "groups": 1}
    assert "| 1 | 2048 | 1536 |" in out and "| 8 | 768 | 2048 |" in out


def test_peer_moe_says_not_installed_without_vllms_venv(tmp_path, monkeypatch, capsys):
    """benchmarks/peer_moe.py is optional: without .venv-vllm it measures and writes nothing."""
    import peer_moe
    monkeypatch.setattr(peer_moe, "VLLM_PKG", tmp_path / "absent")
    assert peer_moe.main(["--out", str(tmp_path)]) == {}
    assert "vLLM not installed (make peer-vllm)" in capsys.readouterr().out
    assert not list(tmp_path.glob("peer_moe*"))


@pytest.mark.parametrize("rows,why", [("0", "at least one row"), ("2,-1", "at least one row"),
                                      ("four", "whole numbers"), ("1.5", "whole numbers")])
def test_peer_moe_refuses_bad_rows_before_anything_runs(rows, why, tmp_path, capsys):
    """--rows names what is wrong with it and exits 2, installed vLLM or not, writing nothing."""
    import peer_moe
    with pytest.raises(SystemExit) as e:
        peer_moe.main(["--rows", rows, "--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--rows {rows!r}" in err and why in err
    assert not list(tmp_path.iterdir())


@pytest.mark.timeout(300)
def test_table_ab_links_two_builds_and_compares_their_bytes(tmp_path, capsys):
    """benchmarks/table_ab.py --smoke: HEAD's kernel table, renamed, and the working tree's link
    into one executable and run the fp32 and bf16 x bf16 linears alternately (the bench raises if
    any output byte differs between the builds); a CPU without the table measures nothing and
    says so. Writes nothing under --smoke."""
    import subprocess
    import table_ab
    head = subprocess.run(["git", "-C", str(table_ab.REPO), "show", "HEAD:kernels/csrc/kernels.h"],
                          capture_output=True, text=True, check=True).stdout
    (tmp_path / "head_kernels.h").write_text(head)
    edited = table_ab._code(tmp_path / "head_kernels.h") != table_ab._code(
        table_ab.REPO / "kernels" / "csrc" / "kernels.h")
    (tmp_path / "head_kernels.h").unlink()
    if edited:  # a working tree whose kernels.h code differs from HEAD's: the refusal is the answer
        with pytest.raises(SystemExit, match="kernels.h differs"):
            table_ab.main(["--smoke", "--out", str(tmp_path)])
        return
    res = table_ab.main(["--smoke", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert not list(tmp_path.iterdir())
    if not res:
        assert "runs no" in out
        return
    assert [h["rows"] for h in res["hot"]] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 64, 256]
    assert all(h["base_GFLOPs"] > 0 and h["new_GFLOPs"] > 0 for h in res["hot"])
    assert [x["shape"] for x in res["linear"]] == ["64 x 256 x 64"]
    assert "| 64 x 256 x 64 |" in out
    assert [h["rows"] for h in res["hot_bf16"]] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 64, 256]
    assert all(h["base_GFLOPs"] > 0 and h["new_GFLOPs"] > 0 for h in res["hot_bf16"])
    assert [x["shape"] for x in res["linear_bf16"]] == ["64 x 256 x 64"]


def test_table_ab_refuses_a_base_whose_table_layout_may_differ(tmp_path, monkeypatch):
    """A base ref whose kernels.h differs from the working tree's cannot share the harness's
    view of the Kernels struct: refused by name before anything is compiled."""
    import table_ab
    real = table_ab.subprocess.run

    def fake_run(cmd, *a, **kw):
        if cmd[:2] == ["tar", "-x"]:
            real(cmd, *a, **kw)
            h = Path(cmd[3]) / "kernels" / "csrc" / "kernels.h"
            h.write_text(h.read_text() + "\nstruct AnotherLayout { int field; };\n")
            return None
        return real(cmd, *a, **kw)
    monkeypatch.setattr(table_ab.subprocess, "run", fake_run)
    with pytest.raises(SystemExit, match="kernels.h differs"):
        table_ab.build("HEAD", tmp_path)


def test_table_ab_compares_kernels_h_without_its_comments(tmp_path):
    """A comment changes no layout: two headers that differ only in comments and spacing compare
    equal; one more member does not."""
    import table_ab
    a, b, c = tmp_path / "a.h", tmp_path / "b.h", tmp_path / "c.h"
    a.write_text("// the table\nstruct K {\n  int x;  // rows\n};\n")
    b.write_text("// the table, reworded\nstruct K {\n    int x;\n};\n")
    c.write_text("struct K {\n  int x;\n  int y;\n};\n")
    assert table_ab._code(a) == table_ab._code(b)
    assert table_ab._code(a) != table_ab._code(c)


def test_table_ab_names_a_bad_ref_and_bad_rounds(tmp_path):
    """A --base that is no git ref, and --rounds below 1, are refused by name."""
    import table_ab
    with pytest.raises(SystemExit, match="--base 'no-such-ref' gives no kernels/csrc"):
        table_ab.build("no-such-ref", tmp_path)
    with pytest.raises(SystemExit):
        table_ab.main(["--rounds", "0"])
