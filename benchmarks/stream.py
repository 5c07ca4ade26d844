"""How fast one core streams weights while it computes (the batched-decode experts' question,
docs/history/performance-decode.md, 2026-12-04 evening).

    .venv/bin/python benchmarks/stream.py [--mib 1024] [--repeats 3]

Builds benchmarks/stream_bench.cpp with the kernel tables (kernels/csrc/isa_*.cpp, the
extension's flags) and runs it on one thread (both parts) and on OMP_NUM_THREADS (default 2; the
kernel's cold part only):
1. a synthetic stream: a cold array read as S interleaved streams (S = 2, 4, 8, 16), with and
   without a prefetch 1 KB ahead in each, with 0, 8 or 16 8-wide fp32 FMAs per 64-byte line
   (16: the arithmetic an 8-row fp32 dot tile does per weight line);
   beside it the arithmetic alone (the same FMAs on hot lines). It tells how many streams a core
   needs for its bandwidth and whether arithmetic hides under the stream;
2. the kernel table's fp32 linear_panel as moe_experts' gate_up stage runs it, 1-16 rows an
   expert, over cold weights and hot (in L2).
Writes benchmarks/results/stream.md (+ .json).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, when run as a script
from benchlib import RESULTS_DIR, build_kernel_bench, machine_meta, md_table, write_results  # noqa: E402



def run(exe: Path, mib: int, repeats: int, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    lines = subprocess.run([str(exe), str(mib), str(repeats)], capture_output=True, text=True, env=env,
                           check=True).stdout.splitlines()
    out = {"synthetic": [], "arith": {}, "panel": [], "table": None}
    for line in lines:
        f = line.split("|")
        if f[0] == "table":
            out["table"] = f[1]
        elif f[0] == "synthetic":
            out["synthetic"].append({"streams": int(f[1]), "prefetch": f[2] == "1", "fmas": int(f[3]),
                                     "GBs": float(f[4])})
        elif f[0] == "arith":
            out["arith"][int(f[1])] = float(f[2])
        elif f[0] == "panel":
            out["panel"].append({"rows": int(f[1]), "state": f[2], "GBs": float(f[3]), "GFLOPs": float(f[4])})
    return out


def tables(res: dict, mib: int) -> list:
    nbytes = mib * 2 ** 20
    syn = []
    for r in res["synthetic"]:
        stream_s = nbytes / (r["GBs"] * 1e9)
        arith = res["arith"].get(r["fmas"], 0.0)
        syn.append([r["streams"], "1 KB ahead" if r["prefetch"] else "none", r["fmas"], f"{r['GBs']:.1f}",
                    f"{1e3 * stream_s:.1f}", f"{1e3 * arith:.1f}" if r["fmas"] else "-"])
    pan = [[r["rows"], r["state"], f"{r['GBs']:.1f}", f"{r['GFLOPs']:.0f}"] for r in res["panel"]]
    out = [md_table(["streams", "prefetch", "FMAs / line", "GB/s", "ms", "arithmetic alone, ms"], syn), ""] \
        if syn else []
    return out + [md_table(["rows an expert", "weights", "GB/s", "GFLOP/s"], pan)]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=1024, help="MiB of the cold array and of the experts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    a = ap.parse_args(argv)
    meta = machine_meta()
    threads = int(os.environ.get("OMP_NUM_THREADS", "2"))
    with tempfile.TemporaryDirectory() as tmp:
        exe = build_kernel_bench("stream_bench", Path(tmp))
        res = {t: run(exe, a.mib, a.repeats, t) for t in sorted({1, threads})}
    md = [f"# One core's weight stream under arithmetic ({meta['date']})", "",
          f"{meta['cpu']}; kernel table **{res[1]['table']}**; {a.mib} MiB cold; best of "
          f"{a.repeats}. `benchmarks/stream.py` (stream_bench.cpp).", ""]
    for t, r in res.items():
        md += [f"## {t} thread{'s' if t > 1 else ''}", ""] + tables(r, a.mib) + [""]
    md += ["'ms': the cold pass; 'arithmetic alone': the same FMAs on hot lines. Where the pass "
           "takes about the larger of the stream alone (FMAs 0) and the arithmetic alone, the "
           "arithmetic hides under the stream; where it takes about their sum, it does not.", ""]
    text = "\n".join(md)
    write_results(a.out, "stream", text, {"meta": meta, "mib": a.mib, "results": res})
    print(text)
    return res


if __name__ == "__main__":
    main()
