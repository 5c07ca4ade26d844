"""Batched decode, the rollout's shape: B sequences stepping together on 30B-A3B-shaped layers,
against the machine's bound and, when installed, vLLM's CPU engine on the same checkpoint.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/decode_bench.py            # ~5 min (no peer)
    make peer-vllm && OMP_NUM_THREADS=2 .venv/bin/python benchmarks/decode_bench.py --peer
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/decode_bench.py --smoke    # seconds

Per dtype and batch (prompts of --prompt-len random ids, --new greedy tokens, eos ignored):
  * tonp's decode-step tokens/s (median step after the prefill forward) and its fraction of the
    step's roofline, op class by op class (roofline.decode_step_bound): dense linears, experts
    (the distinct experts the steps touched, counted through the probe seam), attention's KV
    read, each at the larger of its bytes over the read bandwidth (the better of the probes taken
    just before and just after the reported round's generate) and its FLOPs over the dtype's best
    GEMM rate measured in this run (at its start and end; fp32: MKL's or tonp's; bf16: stock
    torch's matmul or tonp's linear); also
    against the whole step's max(bytes, FLOPs) bound, which a sequential forward cannot reach;
  * the engine's own time per step outside the model's forward (scheduling, input building,
    sampling: the Python overhead), reported apart;
  * where a step's time goes: one profiled pass per batch after its timed rounds, the experts,
    the dense linears and attention each against its own bound and the rates each reached, and
    the rest of the forward (step_breakdown.py);
  * end-to-end generated tokens/s of one `generate` call (prefill included) for tonp and, with
    --peer, vLLM (`benchmarks/peer_vllm.py` in `.venv-vllm`), alternated round by round with the
    idle engine paused (SIGSTOP), best of --rounds after a 2-token warm-up of the same batch;
    their ratio, and the ratio of their decode steps alone (each generate less the same prompts' 1-token generate), with the
    read bandwidth probed around each engine's round (a ratio of rounds on buses more than 20%
    apart is marked), and the median ratio over the rounds whose two runs saw one bus;
  * whether each engine's logprobs of prompt 0 at batch 1 equal those at batch B (tonp:
    torch.equal; vLLM: the number of differing positions).
Writes benchmarks/results/decode{,_quick,_smoke}.{md,json}, or decode_<machine>... where that file
holds another machine's run (benchlib.record_stem: decode.md is the Intel Xeon's record,
decode_amd_epyc.md the AMD EPYC's with AVX512-BF16).
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import roofline  # noqa: E402
from benchlib import (RESULTS_DIR, ForwardClock, busy_warning, fmt, fmt_ratio, log,  # noqa: E402
                      machine_meta, md_table, write_record)
from step_breakdown import breakdown_cell, breakdown_section, step_breakdown  # noqa: E402

import tonp_kernels as tk  # noqa: E402
from tonp_models import Qwen3MoeConfig, Qwen3MoeForCausalLM, generate  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PEER_PY = REPO / ".venv-vllm" / "bin" / "python"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Tokens a forward feeds at most, both engines: vLLM's own default for its LLM class on CPU
# (max_num_batched_tokens 4096, chunked prefill), given to tonp's generate as max_step_tokens. It
# bounds the prefill's activations (batch 128 x 64 prompt tokens is 8192), which with the fp32
# model, its weight groups and vLLM's engine beside them did not fit in 23 GB. No bit changes.
STEP_TOKENS = 4096
PEER_KV_GB = "1"   # vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE): batch 128 needs ~50 MB here


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--batches", default=None, help="default 1,16,64,128 (--smoke: 1,4)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=16384, help="151936 = Qwen3's full vocabulary")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds after a warm-up")
    ap.add_argument("--peer", action="store_true", help="also run vLLM (needs make peer-vllm)")
    ap.add_argument("--peer-eager", action="store_true", help="vLLM without torch.compile (its "
                    "default compiles the model first: many minutes on a loaded 2-core machine)")
    ap.add_argument("--quick", action="store_true", help="batches 1,16; one round")
    ap.add_argument("--smoke", action="store_true", help="tiny model, checks the code runs")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {a.rounds}")
    return a


def make_config(a) -> Qwen3MoeConfig:
    if a.smoke:
        # head_dim 32: the least vLLM's CPU attention takes (so --smoke --peer checks the peer)
        return Qwen3MoeConfig.preset("tiny", num_hidden_layers=1, head_dim=32,
                                     bos_token_id=None, eos_token_id=None)
    return Qwen3MoeConfig.preset("qwen3_30b_a3b", num_hidden_layers=a.layers,
                                 vocab_size=a.vocab, max_position_embeddings=4096,
                                 bos_token_id=None, eos_token_id=None)


def tonp_run(model, prompts: List[List[int]], new: int, weight_groups: bool = True) -> dict:
    """One greedy generate of `prompts`: its wall time, decode-step times and the engine's time
    per step outside the forward (None with new = 1: the prefill alone), and prompt 0's
    logprobs. weight_groups: generate's (the bf16 experts' column groups, kept by the model
    between calls, so only a first call packs them)."""
    clock = ForwardClock(model)
    t0 = time.perf_counter()
    with tk.use("invariant"):
        out = generate(clock, prompts, new, max_batch_size=len(prompts),
                       weight_groups=weight_groups, max_step_tokens=STEP_TOKENS)
    wall = time.perf_counter() - t0
    assert all(len(c) == new for c in out.completions), "generation stopped early"
    starts = [s for s, _ in clock.spans[1:]] + [t0 + wall]
    steps = [b - a for a, b in zip(starts[:-1], starts[1:])]
    fwd = [e - s for s, e in clock.spans[1:]]
    over = [st - f for st, f in zip(steps, fwd)]
    med = lambda v: statistics.median(v) if v else None  # noqa: E731
    return {"wall_s": wall, "step_s": med(steps), "overhead_s": med(over), "forward_s": med(fwd),
            "logprobs0": out.logprobs[0].clone()}


def _die_with_parent() -> None:
    """In the peer's child, before exec: SIGKILL when this process dies (Linux prctl
    PR_SET_PDEATHSIG). The peer sits stopped (SIGSTOP) between turns, so it would never see its
    stdin close: a decode_bench killed for memory left a paused vLLM holding 10 GB."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
    except OSError:
        pass


class Peer:
    """vLLM in its own venv and process group, paused between its turns (killed with us)."""

    def __init__(self, ckpt: str, dtype: str, max_len: int, max_seqs: int, eager: bool):
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE=PEER_KV_GB)
        env.pop("PYTHONPATH", None)         # vLLM's venv imports nothing of this checkout
        pre = [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",) if
               os.path.exists(p)]
        if pre:
            env["LD_PRELOAD"] = ":".join(pre + [env.get("LD_PRELOAD", "")]).rstrip(":")
        self.proc = subprocess.Popen(
            [str(PEER_PY), str(REPO / "benchmarks" / "peer_vllm.py"), "--model", ckpt,
             "--dtype", {"bf16": "bfloat16", "fp32": "float32"}[dtype], "--max-model-len",
             str(max_len), "--max-num-seqs", str(max_seqs), "--max-num-batched-tokens", str(STEP_TOKENS)]
            + (["--eager"] if eager else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, env=env, start_new_session=True, preexec_fn=_die_with_parent)
        self.lines: "queue.Queue" = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        hello = self._read(1800)
        self.version = hello.get("vllm")
        self.pause()

    def _pump(self) -> None:
        """A thread: every JSON line of the peer's stdout onto a queue (vLLM also prints other
        lines there; select() on the pipe under a buffered readline would lose lines)."""
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))
        self.lines.put(None)

    def _read(self, timeout: float) -> dict:
        try:
            out = self.lines.get(timeout=timeout)
        except queue.Empty:
            out = None
        if out is None:
            raise RuntimeError(f"decode_bench: vLLM did not answer (exit {self.proc.poll()})")
        return out

    def pause(self):
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self):
        os.killpg(self.proc.pid, signal.SIGCONT)

    def run(self, prompts: List[List[int]], new: int) -> dict:
        self.resume()
        try:
            self.proc.stdin.write(json.dumps({"prompts": prompts, "new": new}) + "\n")
            self.proc.stdin.flush()
            out = self._read(1800)
        finally:
            self.pause()
        return {"wall_s": out["seconds"], "logprobs0": out["logprobs"][0]}

    def close(self):
        with_ok = self.proc.poll() is None
        if with_ok:
            self.resume()
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def bf16_gemm_GFLOPs(size: str) -> dict:
    """bf16 x bf16 GEMM GFLOP/s of this process's threads: stock torch's matmul (oneDNN; AMX
    where the CPU has it) and tonp's linear (vdpbf16ps pair chains where the CPU has them), at
    M=512, K=2048, N=2048 (N 256 for --smoke); the faster is the bf16 compute bound (on a CPU
    with AVX512-BF16 or AMX it is above the fp32 rate, so fp32's rate is no bound for bf16)."""
    from benchlib import timeit
    M, K, N = (64, 256, 256) if size == "smoke" else (512, 2048, 2048)
    x, w = torch.randn(M, K).bfloat16(), torch.randn(N, K).bfloat16()
    kw = dict(repeat=3, max_total_s=2 if size == "smoke" else 6, stat="min")
    with tk.use("torch"):
        stock = 2 * M * K * N / timeit(lambda: torch.mm(x, w.t()), **kw).seconds / 1e9
    own = 2 * M * K * N / timeit(lambda: tk.linear(x, w), **kw).seconds / 1e9
    return {"gemm_bf16_GFLOPs": max(stock, own), "gemm_bf16_stock_GFLOPs": stock,
            "gemm_bf16_tonp_GFLOPs": own}


def apart(a: List[float], b: List[float]) -> bool:
    """Whether two rounds ran on buses more than 20% apart (the better probe around each)."""
    x, y = max(a), max(b)
    return max(x, y) > 1.2 * min(x, y)


def bus_mark(r: dict) -> str:
    """'*' where the reported tonp and vLLM rounds ran on buses more than 20% apart: their ratio
    then measures the bus as much as the engines."""
    if "vllm_read_GBs_round" not in r:
        return ""
    return "*" if apart(r["read_GBs_round"], r["vllm_read_GBs_round"]) else ""


def one_bus(pairs: List[dict]) -> List[dict]:
    """The rounds whose two engines, run back to back, saw one bus (probes within 20%)."""
    return [p for p in pairs if not apart(p["tonp_probes"], p["vllm_probes"])]


def same_bus_ratio(pairs: List[dict]) -> Optional[float]:
    """tonp / vLLM end to end from the one-bus rounds: the median over them of vLLM's wall time
    over tonp's (None when there is none)."""
    r = [p["vllm_wall_s"] / p["tonp_wall_s"] for p in one_bus(pairs)]
    return statistics.median(r) if r else None


def bound(cfg, machine: dict, dtype: str, batch: int, context: float, read_GBs: float,
          distinct_experts: Optional[float]) -> dict:
    """The step's roofline, op class by op class (roofline.decode_step_bound): the sum of each
    class's max(bytes over the read bandwidth, FLOPs over the dtype's best GEMM rate)."""
    rate = machine["gemm_bf16_GFLOPs" if dtype == "bf16" else "gemm_fp32_GFLOPs"]
    return roofline.decode_step_bound(cfg, 2 if dtype == "bf16" else 4, batch, context, read_GBs,
                                      rate, distinct_experts)


def routing_spread(model, prompts: List[List[int]]) -> Optional[float]:
    """Experts per layer a decode step of these prompts touches (mean over steps and layers),
    counted through the probe seam in an untimed 4-token generate: the bytes the step must read
    (a model whose router favours some experts touches fewer than uniform routing would)."""
    from tonp_models.layers.probe import pop_hook, push_hook
    counts: List[int] = []

    def hook(op, value, **meta):
        if op == "route.ids" and value.shape[0] == len(prompts):   # decode steps, not the prefill
            counts.append(int(value.unique().numel()))
    push_hook(hook)
    try:
        with tk.use("invariant"):
            generate(model, prompts, 4, max_batch_size=len(prompts))
    finally:
        pop_hook(hook)
    return statistics.mean(counts) if counts else None


def main(argv=None) -> dict:
    a = parse_args(argv)
    batches = [1, 16] if a.quick else [int(b) for b in (a.batches or "1,16,64,128").split(",")]
    if a.smoke:
        batches = [int(b) for b in a.batches.split(",")] if a.batches else [1, 4]
        a.new, a.prompt_len, a.rounds = 4, 8, 1
    rounds = 1 if a.quick else a.rounds
    cfg = make_config(a)
    meta = machine_meta()
    size = "smoke" if a.smoke else "quick" if a.quick else "full"
    machine = roofline.measure_machine(size)
    machine.update(bf16_gemm_GFLOPs(size))
    log(f"decode_bench: {meta['cpu']}, isa {meta['isa']}, {meta['threads']} threads; read "
        f"{machine['read_GBs']:.1f} GB/s, fp32 GEMM {machine['gemm_fp32_GFLOPs']:.0f} GFLOP/s, "
        f"bf16 GEMM {machine['gemm_bf16_GFLOPs']:.0f} GFLOP/s")
    use_peer = a.peer and PEER_PY.exists()
    peer_note = "" if use_peer else ("not installed (make peer-vllm)" if not PEER_PY.exists()
                                     else "not asked (--peer)")
    rows, brk_rows, data = [], [], {"meta": meta, "machine": machine, "config": cfg.__dict__, "results": []}
    g = torch.Generator().manual_seed(0)
    all_prompts = torch.randint(0, cfg.vocab_size, (max(batches), a.prompt_len), generator=g)
    context = a.prompt_len + a.new / 2
    for dname in a.dtypes.split(","):
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(cfg, dtype=DTYPES[dname]).eval()
        peer, tmp = None, None
        if use_peer:
            tmp = tempfile.TemporaryDirectory(prefix="tonp-peer-")
            from tonp_models.qwen3_moe.checkpoint import save_checkpoint
            save_checkpoint(model, tmp.name)
            log(f"decode_bench: starting vLLM ({dname})")
            peer = Peer(tmp.name, dname, a.prompt_len + a.new + 16, max(batches),
                        eager=a.peer_eager or a.smoke)
            data["vllm_eager"] = a.peer_eager or a.smoke
        try:
            # Prompt 0 alone: the batch-1 logprobs every batch's prompt 0 is compared with (run
            # here, not taken from the first batch measured, which need not be batch 1).
            one = all_prompts[:1].tolist()
            ref_tonp = tonp_run(model, one, a.new)["logprobs0"]
            ref_peer = peer.run(one, a.new)["logprobs0"] if peer is not None else None
            for b in batches:
                prompts = all_prompts[:b].tolist()
                torch.ops.tonp.release_memory_pool()   # the last batch's idle activations
                # Warm-up: a 2-token generate of this batch, both engines. A batch's first call
                # grows tonp's memory pool to the batch's activations (vLLM allocates its own at
                # start-up): the first of five fp32 batch-64 rounds after a 1-prompt warm-up ran
                # 12.7 s, the others 11.1-11.7 s, and the one-bus median counted it.
                tonp_run(model, prompts, 2)
                if peer is not None:
                    peer.run(prompts, 2)
                best_t, best_p = None, None
                pre_t, pre_p = float("inf"), float("inf")  # the prefill alone: a 1-token generate
                # The read bandwidth just before and just after each timed generate: the bound of
                # the round reported takes the better of its own two probes. This VM's bus moves
                # between states (33-36 and 52-63 GB/s probed within one run), so a probe of
                # another round can describe a bus the reported steps never saw.
                probes, pairs = [], []  # pairs: each round's two engines, back to back
                mib = 64 if a.smoke else 256
                for _ in range(rounds):
                    before = roofline.read_bandwidth_now(mib)
                    t = tonp_run(model, prompts, a.new)
                    t["probes"] = [before, roofline.read_bandwidth_now(mib)]
                    probes.append(t["probes"])
                    best_t = t if best_t is None or t["wall_s"] < best_t["wall_s"] else best_t
                    pre_t = min(pre_t, tonp_run(model, prompts, 1)["wall_s"])
                    if peer is not None:
                        before = roofline.read_bandwidth_now(mib)
                        p = peer.run(prompts, a.new)
                        p["probes"] = [before, roofline.read_bandwidth_now(mib)]
                        best_p = p if best_p is None or p["wall_s"] < best_p["wall_s"] else best_p
                        pairs.append({"tonp_wall_s": t["wall_s"], "tonp_probes": t["probes"],
                                      "vllm_wall_s": p["wall_s"], "vllm_probes": p["probes"]})
                        pre_p = min(pre_p, peer.run(prompts, 1)["wall_s"])
                brk = (step_breakdown(lambda n: tonp_run(model, prompts, n), a.new, mib)
                       if a.new > 1 else None)
                r = {"dtype": dname, "batch": b, "tonp_step_s": best_t["step_s"],
                     "tonp_step_tok_s": b / best_t["step_s"],
                     "tonp_forward_s": best_t["forward_s"], "tonp_overhead_s":
                     best_t["overhead_s"], "tonp_e2e_tok_s": b * a.new / best_t["wall_s"],
                     "read_GBs_probes": probes, "read_GBs_round": best_t["probes"],
                     "distinct_experts": routing_spread(model, prompts),
                     "tonp_batch_invariant": torch.equal(best_t["logprobs0"], ref_tonp),
                     "tonp_prefill_tok_s": b * a.prompt_len / pre_t, "breakdown": brk}
                if best_p is not None:
                    r["vllm_e2e_tok_s"] = b * a.new / best_p["wall_s"]
                    r["vllm_read_GBs_round"] = best_p["probes"]
                    r["tonp_over_vllm"] = r["tonp_e2e_tok_s"] / r["vllm_e2e_tok_s"]
                    r["rounds"] = pairs
                    r["tonp_over_vllm_same_bus"] = same_bus_ratio(pairs)
                    r["same_bus_rounds"] = len(one_bus(pairs))
                    r["vllm_prefill_tok_s"] = b * a.prompt_len / pre_p
                    # The decode steps alone: each engine's generate less its 1-token generate
                    # (both best of the rounds), over the new - 1 steps after the first token.
                    if a.new > 1:
                        r["tonp_decode_steps_s"] = (best_t["wall_s"] - pre_t) / (a.new - 1)
                        r["vllm_decode_steps_s"] = (best_p["wall_s"] - pre_p) / (a.new - 1)
                        r["decode_tonp_over_vllm"] = r["vllm_decode_steps_s"] / r["tonp_decode_steps_s"]
                    r["vllm_differ_vs_batch1"] = sum(
                        x != y for x, y in zip(best_p["logprobs0"], ref_peer))
                data["results"].append(r)
                log(f"  {dname} batch {b}: tonp step {1e3 * r['tonp_step_s']:.1f} ms, e2e "
                    f"{r['tonp_e2e_tok_s']:.1f} tok/s, vLLM {r.get('vllm_e2e_tok_s')}")
        finally:
            if peer is not None:
                data["vllm_version"] = peer.version
                peer.close()
            if tmp is not None:
                tmp.cleanup()
            # This dtype's model (and the expert weight groups it holds) and the pool's idle
            # blocks go before the next dtype's model and peer load: with fp32's groups (the
            # experts' size again) and vLLM's copy beside them, a 24 GB machine has no room to
            # spare (a run that kept them was killed for memory).
            model = None
            gc.collect()
            torch.ops.tonp.release_memory_pool()
    # The machine's rates once more at the end; each bound takes the best of both (a rate
    # measured while the machine was slow is no bound), and the best read probe around its steps.
    end = roofline.measure_machine(size)
    end.update(bf16_gemm_GFLOPs(size))
    data["machine_end"] = end
    for k in ("gemm_fp32_GFLOPs", "gemm_bf16_GFLOPs"):
        machine[k] = max(machine[k], end[k])
    for r in data["results"]:
        bd = bound(cfg, machine, r["dtype"], r["batch"], context, max(r["read_GBs_round"]),
                   r["distinct_experts"])
        r.update(bound=bd, read_GBs=max(r["read_GBs_round"]),
                 fraction_of_bound=bd["bound_s"] / r["tonp_step_s"],
                 fraction_of_coarse_bound=bd["coarse_bound_s"] / r["tonp_step_s"])
        brk = r["breakdown"]
        if brk is not None:
            bb = bound(cfg, machine, r["dtype"], r["batch"], context, max(brk["read_GBs"]),
                       r["distinct_experts"])
            parts = bb["parts"]
            brk["bound_s"] = {c: max(parts[c]["mem_s"], parts[c]["compute_s"]) for c in parts}
            brk_rows.append([r["dtype"], r["batch"], f"{1e3 * brk['step_s']:.1f} ms",
                             *[breakdown_cell(brk["classes_s"][c], parts.get(c))
                               for c in ("experts", "dense", "attention", "rest")],
                             f"{1e3 * brk['overhead_s']:.1f} ms",
                             " / ".join(f"{g:.0f}" for g in brk["read_GBs"])])
        rows.append([r["dtype"], r["batch"], fmt(r["tonp_step_tok_s"]), bd["kind"],
                     " / ".join(f"{g:.0f}" for g in r["read_GBs_round"]),
                     " / ".join(f"{g:.0f}" for g in r.get("vllm_read_GBs_round", [])) or "-",
                     f"{100 * r['fraction_of_bound']:.0f}%",
                     f"{100 * r['fraction_of_coarse_bound']:.0f}%",
                     f"{bd['distinct_experts']:.0f}",
                     f"{1e3 * r['tonp_overhead_s']:.1f} ms",
                     fmt(r["tonp_e2e_tok_s"]), fmt(r.get("vllm_e2e_tok_s")),
                     fmt_ratio(r.get("tonp_over_vllm")) + bus_mark(r),
                     (f"{fmt_ratio(r.get('tonp_over_vllm_same_bus'))} ({r['same_bus_rounds']} of {len(r['rounds'])})"
                      if "rounds" in r else "-"),
                     fmt_ratio(r.get("decode_tonp_over_vllm")) + bus_mark(r),
                     fmt(r["tonp_prefill_tok_s"]),
                     fmt(r.get("vllm_prefill_tok_s")),
                     fmt_ratio(r.get("vllm_prefill_tok_s") and
                               r["tonp_prefill_tok_s"] / r["vllm_prefill_tok_s"]),
                     "yes" if r["tonp_batch_invariant"] else "NO",
                     str(r.get("vllm_differ_vs_batch1", "-"))])
    head = ["dtype", "batch", "tonp decode tok/s", "bound", "read GB/s before / after",
            "read GB/s around vLLM's round",
            "of bound", "of whole-step bound",
            "experts / layer", "engine overhead/step",
            "tonp e2e tok/s", "vLLM e2e tok/s", "tonp / vLLM", "tonp / vLLM, one-bus rounds",
            "decode steps tonp / vLLM",
            "tonp prefill tok/s",
            "vLLM prefill tok/s", "prefill tonp / vLLM", "tonp bits = batch 1",
            f"vLLM logprobs differing from batch 1 (of {a.new})"]
    md = (f"# Batched decode\n\n{meta['date']}; {meta['cpu']}; kernel table **{meta['isa']}**; "
          f"{meta['threads']} threads; model: {'tiny' if a.smoke else '30B-A3B shapes'}, "
          f"{cfg.num_hidden_layers} layer(s), vocab {cfg.vocab_size}; prompts {a.prompt_len} "
          f"tokens, {a.new} greedy new; read "
          f"bandwidth {machine['read_GBs']:.1f} GB/s, GEMM fp32 {machine['gemm_fp32_GFLOPs']:.0f} / "
          f"bf16 {machine['gemm_bf16_GFLOPs']:.0f} GFLOP/s (best of stock torch and tonp each). "
          f"vLLM: {data.get('vllm_version') or peer_note}"
          f"{' (eager)' if data.get('vllm_eager') else ''}.\n"
          f"{busy_warning(meta)}\n\n" + md_table(head, rows) + "\n\n'of bound': the step's "
          "roofline over the measured decode step, op class by op class (dense linears, experts, "
          "attention's KV read, the rest), each at the larger of its bytes over the read "
          "bandwidth (the better of the two probes taken just before and just after the "
          "reported round's generate, 'read GB/s') and its "
          "FLOPs over the dtype's GEMM rate (the better of the run's start and end); 'bound' "
          "says which binds (mixed: the experts stream while the dense linears compute). "
          "'of whole-step bound': the same over max(all bytes over the "
          "bandwidth, all FLOPs over the rate), which no sequential forward can reach when the "
          "classes bind differently. 'experts / layer': distinct experts a decode step touched, "
          "counted through the probe seam (uniform routing: 8, 82, 126, 128). 'engine "
          "overhead': the median step's time outside the model's forward. e2e: generated tokens over one "
          "generate call's wall time, prefill included, best of the rounds. 'decode steps': "
          "each engine's generate less its 1-token generate, over the steps after the first "
          "token (vLLM's time over tonp's); a ratio marked * compares rounds whose buses "
          "differed by more than 20% (the better probe around each engine's reported round: "
          "this VM's read bandwidth moves between about 33 and 60 GB/s). 'one-bus rounds': the "
          "engines run back to back in every round; the median over the rounds whose two runs "
          "saw one bus (probes within 20%) of vLLM's generate time over tonp's, and how many "
          "rounds that was. prefill: prompt "
          "tokens over the wall time of a 1-token generate of the same prompts, best of the "
          "rounds.\n")
    if brk_rows:
        md += breakdown_section(brk_rows)
    stem = "decode_smoke" if a.smoke else "decode_quick" if a.quick else "decode"
    paths = write_record(a.out, stem, md, data)  # never over another machine's record
    print(md)
    log("decode_bench: wrote " + ", ".join(str(p) for p in paths))
    return data


if __name__ == "__main__":
    main()
