"""A GRPO-shaped rollout workload: P prompts x G samples (all prompts share a system prefix),
through the engine with prefix caching on and off, and through the HTTP server.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/serve_bench.py            # ~2 min
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/serve_bench.py --quick    # ~30 s

Each round draws new prompts (so neither the server's prefix cache nor anything else carries
over between rounds) and runs every contender on them, one after the other: "engine, prefix
cache" and "engine, no prefix cache" (`tonp_models.generate`, a fresh engine per call), and
"server, prefix cache" (`python -m tonp_models.serve` on loopback, same model and settings,
through `RolloutClient`, i.e. /generate). Reported: prefill tokens computed, cache hits, wall
time (median over rounds) and the ratios, all measured in this run; the server's tokens must be
the in-process engine's. Writes benchmarks/results/serve{,_quick}.{md,json}.

OMP_WAIT_POLICY defaults to PASSIVE here (both processes): on an oversubscribed machine, libgomp's
spinning workers made the in-process engine's main thread 5-50x slower, at random, than the same
engine in a thread (measured on the shared 2-core machine; docs/serving.md).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (RESULTS_DIR, busy_warning, fmt, fmt_ratio, log, machine_meta,  # noqa: E402
                      md_table, write_results)

REPO = Path(__file__).resolve().parents[1]
CASES = ("engine, prefix cache", "engine, no prefix cache", "server, prefix cache")
# The full run's model: Qwen3-30B-A3B's architecture, narrowed to run in seconds on 2 cores.
SMALL = ["hidden_size=512", "num_hidden_layers=4", "num_attention_heads=8",
         "num_key_value_heads=2", "head_dim=64", "intermediate_size=1024",
         "moe_intermediate_size=256", "num_experts=16", "num_experts_per_tok=4",
         "vocab_size=8192", "max_position_embeddings=2048"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--preset", default=None, help="default: qwen3_30b_a3b narrowed (SMALL), "
                    "tiny with --quick")
    ap.add_argument("--set", action="append", default=None, metavar="KEY=VALUE")
    ap.add_argument("--prompts", type=int, default=None, help="P (default 8, quick 4)")
    ap.add_argument("--group", type=int, default=8, help="G samples per prompt")
    ap.add_argument("--system-len", type=int, default=64, help="shared prefix of every prompt")
    ap.add_argument("--prompt-len", type=int, default=None, help="tokens after the prefix")
    ap.add_argument("--new", type=int, default=None, help="max new tokens")
    ap.add_argument("--batch", type=int, default=32, help="max running requests")
    ap.add_argument("--step-tokens", type=int, default=256, help="chunked prefill budget")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (after a warm-up)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    a = ap.parse_args(argv)
    quick = a.quick
    if a.preset is None:
        a.preset = "tiny" if quick else "qwen3_30b_a3b"
        a.set = a.set if a.set is not None or quick else SMALL
    a.set = a.set or []
    a.prompts = a.prompts or (4 if quick else 8)
    a.prompt_len = a.prompt_len or (96 if quick else 192)
    a.new = a.new or (8 if quick else 16)
    a.rounds = a.rounds or (2 if quick else 3)
    return a


def workload(a, vocab: int, round_: int):
    g = torch.Generator().manual_seed(1000 + round_)
    system = torch.randint(0, vocab, (a.system_len,), generator=g).tolist()
    prompts = [system + torch.randint(0, vocab, (a.prompt_len,), generator=g).tolist()
               for _ in range(a.prompts)]
    return [p for p in prompts for _ in range(a.group)]


def start_server(a):
    args = [sys.executable, "-m", "tonp_models.serve", "--preset", a.preset, "--port", "0",
            "--max-batch-size", str(a.batch), "--max-step-tokens", str(a.step_tokens),
            "--max-n", str(a.prompts * a.group), "--threads", str(torch.get_num_threads())]
    for s in a.set:
        args += ["--set", s]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    for line in proc.stdout:
        if line.startswith("tonp serve: listening on "):
            return proc, line.split(" on ")[1].strip()
    raise RuntimeError(f"the server did not start (exit {proc.wait()})")


def main(argv=None) -> dict:
    a = parse_args(argv)
    from tonp_models import generate
    from tonp_models.serve import RolloutClient
    from tonp_models.serve.cli import build_model, parse_args as serve_args
    meta = machine_meta()
    sets = [x for s in a.set for x in ("--set", s)]
    model = build_model(serve_args(["--preset", a.preset, *sets]), None)  # the server's model
    config = model.config
    log(f"serve_bench: {a.prompts} prompts x {a.group} samples, {a.system_len}+{a.prompt_len} "
        f"prompt tokens, {a.new} new, {a.rounds} rounds, load {meta['load_before']:.1f}")
    proc, url = start_server(a)
    client = RolloutClient(url)
    kw = dict(temperature=1.0, seed=3)
    runs = {
        CASES[0]: lambda ps: generate(model, ps, a.new, max_batch_size=a.batch,
                                      max_step_tokens=a.step_tokens, **kw),
        CASES[1]: lambda ps: generate(model, ps, a.new, max_batch_size=a.batch,
                                      max_step_tokens=a.step_tokens, prefix_cache=False, **kw),
        CASES[2]: lambda ps: client.generate(ps, a.new, **kw),
    }
    samples = {c: [] for c in CASES}
    stats = {}
    try:
        for r in range(a.rounds + 1):                  # round 0 warms up
            ps = workload(a, config.vocab_size, r)
            outs = {}
            for case, fn in runs.items():
                t0 = time.perf_counter()
                outs[case] = fn(ps)
                if r:
                    samples[case].append(time.perf_counter() - t0)
            for x, y in zip(outs[CASES[0]].sequences, outs[CASES[2]].sequences):
                assert torch.equal(x, y), "the server's rollout differs from the engine's"
            stats = {c: o.stats for c, o in outs.items()}
    finally:
        proc.terminate()
        proc.wait(30)
    return report(a, meta, samples, stats)


def report(a, meta, samples, stats) -> dict:
    wall = {c: statistics.median(s) for c, s in samples.items()}
    rows, data = [], {"meta": meta, "settings": vars(a) | {"out": str(a.out)}, "cases": {}}
    for c in CASES:
        s = stats[c]
        new_per_s = s.new_tokens / wall[c]
        rows.append([c, s.prefill_tokens, s.cached_tokens, s.new_tokens, fmt(wall[c] * 1e3),
                     fmt(new_per_s)])
        data["cases"][c] = {"prefill_tokens": s.prefill_tokens, "cached_tokens": s.cached_tokens,
                            "new_tokens": s.new_tokens, "wall_s": wall[c],
                            "samples_s": samples[c]}
    on, off, srv = (data["cases"][c] for c in CASES)
    ratios = {"prefill tokens, cache off / on": off["prefill_tokens"] / on["prefill_tokens"],
              "wall time, cache off / on": off["wall_s"] / on["wall_s"],
              "wall time, server / engine (both with the cache)": srv["wall_s"] / on["wall_s"]}
    data["ratios"] = ratios
    md = "\n\n".join(filter(None, [
        f"# Rollout service: a GRPO-shaped workload ({'quick' if a.quick else 'full'})",
        busy_warning(meta),
        f"{a.prompts} prompts x {a.group} samples; every prompt = a {a.system_len}-token shared "
        f"prefix + {a.prompt_len} own tokens; {a.new} new tokens each (temperature 1); "
        f"preset {a.preset} {' '.join(a.set)}; max {a.batch} running, {a.step_tokens}-token "
        f"steps; {meta['threads']} threads on {meta['cpu']}, kernel table {meta['isa']} (load "
        f"{meta['load_before']:.1f}), "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}. "
        f"Median of {a.rounds} rounds after a warm-up, each round new prompts, contenders "
        f"one after the other.",
        md_table(["contender", "prefill tokens", "cache hits", "new tokens", "wall ms",
                  "new tok/s"], rows),
        md_table(["ratio (same run)", "value"], [[k, fmt_ratio(v)] for k, v in ratios.items()]),
        "The server's tokens equal the in-process engine's (checked every round)."]))
    stem = "serve_quick" if a.quick else "serve"
    paths = write_results(a.out, stem, md + "\n", data)
    print("\n" + md)
    log("wrote " + ", ".join(str(p) for p in paths))
    return data


if __name__ == "__main__":
    main()
