"""The fp32 expert weight groups (the lane tiles' order; tonp_kernels.pack_weight_groups) against the
weights in place, in the decode's experts stage.

    .venv/bin/python benchmarks/packed_experts.py [--experts 128] [--repeats 6] [--rounds 3] [--smoke]

Builds benchmarks/packed_experts_bench.cpp with the kernel tables (kernels/csrc/isa_*.cpp, the
extension's flags) and runs, on OMP_NUM_THREADS threads (default 2), moe_experts' fp32 stage over
E cold experts with each candidate in turn: the AVX512-BF16 table's linear_panel on the weights
in place, and the same kernel given each panel's weight group (lane passes at every row count).
Every sample is bracketed by a read-bandwidth probe; since this VM's bus moves between about 35
and 65 GB/s, the table reports the fast-bus samples (both probes at 50 GB/s or more) and the
slow-bus ones apart, and every ratio compares samples of one bus state. The shapes run in rounds
(--rounds), each shape's samples pooled, so that one run is likely to see both states. The
outputs with groups are checked byte for byte against the in-place ones in every sample.
Writes benchmarks/results/packed_experts.md (+ .json; `packed_experts_<machine>` where that holds
another machine's run). AVX-512 machines only (elsewhere it says so and writes nothing).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, when run as a script
from benchlib import RESULTS_DIR, build_kernel_bench, machine_meta, md_table, write_record  # noqa: E402

# (rows an expert, K, N): gate_up and down of the 30B-A3B experts (H 2048, I 768).
SHAPES = [(1, 2048, 1536), (2, 2048, 1536), (4, 2048, 1536), (8, 2048, 1536), (16, 2048, 1536),
          (1, 768, 2048), (4, 768, 2048), (8, 768, 2048)]
CANDIDATES = ("inplace", "groups")
FAST = 50.0  # GB/s: both probes at least this: the fast bus


def run(exe: Path, shape, experts: int, repeats: int, threads: int) -> dict:
    """Samples of one shape: {candidate: [(GB/s of weights, probe before, probe after)]}."""
    rows, K, N = shape
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    lines = subprocess.run([str(exe), str(rows), str(K), str(N), str(experts), str(repeats)], capture_output=True,
                           text=True, env=env, check=True).stdout.splitlines()
    if lines and lines[0].startswith("unsupported|"):
        return {"unsupported": lines[0].split("|", 1)[1]}
    if not lines or lines[-1] != "done":
        raise RuntimeError(f"packed_experts_bench {shape}: no 'done' line")
    gb = experts * N * K * 4 / 1e9
    out = {c: [] for c in CANDIDATES}
    for line in lines[:-1]:
        _, cand, ms, p0, p1, same = line.split("|")
        if same != "1":
            raise RuntimeError(f"packed_experts_bench {shape}: {cand}'s output differs from in place")
        out[cand].append((gb / (float(ms) / 1e3), float(p0), float(p1)))
    return out


def summary(samples: dict) -> list:
    """Per bus state: each candidate's median GB/s over its samples there, and its ratio to in place."""
    rows = []
    for state, keep in (("fast", lambda s: min(s[1], s[2]) >= FAST), ("slow", lambda s: max(s[1], s[2]) < FAST)):
        med = {}
        for c in CANDIDATES:
            got = [s[0] for s in samples[c] if keep(s)]
            med[c] = (statistics.median(got), len(got)) if got else None
        rows.append((state, med))
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=6, help="samples of each candidate per shape and round")
    ap.add_argument("--rounds", type=int, default=3, help="passes over the shapes, samples pooled")
    ap.add_argument("--smoke", action="store_true", help="4 experts, 1 repeat, two shapes; writes nothing")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    a = ap.parse_args(argv)
    experts, repeats, rounds, shapes = ((4, 1, 1, SHAPES[:1] + SHAPES[-1:]) if a.smoke
                                        else (a.experts, a.repeats, a.rounds, SHAPES))
    threads = int(os.environ.get("OMP_NUM_THREADS", "2"))
    meta = machine_meta()
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        exe = build_kernel_bench("packed_experts_bench", Path(tmp))
        for _ in range(rounds):
            for shape in shapes:
                got = run(exe, shape, experts, repeats, threads)
                if "unsupported" in got:
                    print(f"packed_experts: {got['unsupported']}; nothing measured")
                    return {}
                for c, samples in got.items():
                    res.setdefault(shape, {}).setdefault(c, []).extend(samples)
    table = []
    for (rows, K, N), samples in res.items():
        for state, med in summary(samples):
            if med["inplace"] is None:
                continue
            base = med["inplace"][0]
            cells = [f"{med[c][0]:.1f} ({med[c][0] / base:.2f}x, {med[c][1]})" if med[c] else "-"
                     for c in CANDIDATES[1:]]
            table.append([rows, K, N, state, f"{base:.1f} ({med['inplace'][1]})", *cells])
    md = [f"# fp32 expert weight groups against in place ({meta['date']})", "",
          f"{meta['cpu']}; kernel table **{meta['isa']}**; {threads} threads; {experts} cold experts; "
          f"{rounds} rounds of {repeats} repeats, the candidates alternated. `benchmarks/packed_experts.py` "
          "(packed_experts_bench.cpp).", "",
          md_table(["rows an expert", "K", "N", "bus", "in place GB/s (samples)", "groups GB/s (ratio, samples)"],
                   table), "",
          "GB/s: the experts' weight bytes over the stage's time, the median of the samples on that bus "
          f"(fast: both probes around the sample at {FAST:.0f} GB/s or more; slow: both under); the ratio "
          "is to the in-place kernel on the same bus. Every output with groups equalled the in-place one "
          "byte for byte.", ""]
    text = "\n".join(md)
    print(text)
    if not a.smoke:
        write_record(a.out, "packed_experts", text,
                      {"meta": meta, "experts": experts, "repeats": repeats, "rounds": rounds, "threads": threads,
                       "results": {f"{r}x{k}x{n}": v for (r, k, n), v in res.items()}})
    return res


if __name__ == "__main__":
    main()
