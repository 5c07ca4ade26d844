"""A kernel table against the same table at a git ref, in one process: the fp32 linear's
(`Kernels::linear_panel` on weight groups, `pack_lanes`) speed, build against build.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/table_ab.py                  # ~3 min, base HEAD
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/table_ab.py --base HEAD~3 --table avx2
    .venv/bin/python benchmarks/table_ab.py --smoke                            # compiles, tiny shapes

For tuning a kernel where this VM's state moves whole runs by more than the change: the base
build is `kernels/csrc` of `--base` (git archive), compiled with its table's names renamed and
linked beside the working tree's (benchmarks/table_ab_bench.cpp), so both run in one process,
alternated, on the same data; every output is compared byte for byte between the two builds.
Three measurements:
  * hot: one thread, four 16-column panels (in L2), per row count 1-256, K = 2048 and 768; the
    same for bf16 x bf16 (`linear_panel_bf16`, two 64-column panels, 1-256 rows);
  * linear: whole fp32 linears with weight groups on OMP_NUM_THREADS threads (the attention
    projections' and an expert's prefill shapes, and the LM head at a decode batch of 64, whose
    128 MB are cold), tasks split as tk.linear splits them; whole
    bf16 x bf16 linears at a decode batch's 64 rows (projections, LM head) and 256;
  * experts: the experts' two decode stages over 128 cold experts (30B-A3B shapes, weights on
    2 MB pages as a model's), rows an expert drawn from Poisson(1, 4, 8), a read probe around
    each sample; ratios per bus state (fast: both probes at 45 GB/s or more); in fp32
    (`linear_panel` on weight groups) and in bf16 x bf16 (`linear_panel_bf16`'s pair chains).
Refuses a base whose kernels/csrc/kernels.h code (comments aside) differs from the working
tree's (the table layouts
could differ). Writes benchmarks/results/table_ab.{md,json} (`table_ab_<machine>` for another
machine's run); --smoke writes nothing.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, when run as a script
from benchlib import _CXX_FLAGS, RESULTS_DIR, machine_meta, md_table, write_record  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FAST = 45.0  # GB/s
# The base build's names: its tables, namespaces and CPU check, renamed so both builds link.
RENAMES = ["-Dtonp_avx512bf16=tonp_base_avx512bf16_ns", "-Dkernels_avx512bf16=kernels_base_avx512bf16",
           "-Dkernels_avx512bf16_pairs=kernels_base_avx512bf16_pairs",
           "-Dkernels_avx512bf16_bf16=kernels_base_avx512bf16_bf16",
           "-Dtonp_avx2=tonp_base_avx2_ns", "-Dkernels_avx2=kernels_base_avx2",
           "-Dcpu_has_avx2_fma=cpu_has_avx2_fma_base"]
LINEAR = [(4096, 2048, 4096), (4096, 2048, 512), (256, 2048, 1536), (256, 768, 2048),
          (64, 2048, 16384)]  # the last: the LM head at a decode batch of 64
# bf16 x bf16: a decode batch's attention projections and LM head (64 rows), an expert's prefill.
LINEAR_BF16 = [(64, 2048, 4096), (64, 4096, 2048), (64, 2048, 16384), (256, 768, 2048)]


def _code(path: Path) -> str:
    """A C++ header's code: line comments dropped and whitespace collapsed (a comment never
    changes a layout)."""
    return " ".join(re.sub(r"//.*", "", path.read_text()).split())


def build(base: str, out: Path) -> Path:
    """The executable: the base ref's AVX tables (renamed), the working tree's tables, the bench."""
    src = out / "base"
    src.mkdir()
    tar = subprocess.run(["git", "-C", str(REPO), "archive", base, "kernels/csrc"], capture_output=True)
    if tar.returncode != 0:
        raise SystemExit(f"table_ab: --base {base!r} gives no kernels/csrc: {tar.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(src)], input=tar.stdout, check=True)
    here = REPO / "kernels" / "csrc"
    if _code(src / "kernels" / "csrc" / "kernels.h") != _code(here / "kernels.h"):
        raise SystemExit(f"table_ab: kernels/csrc/kernels.h differs between {base} and the working tree; "
                         "the two tables' layouts may differ, so they cannot share one harness")
    units = [(src / "kernels" / "csrc" / f"isa_{n}.cpp", RENAMES, f"base_{n}.o") for n in ("avx512bf16", "avx2")]
    units += [(here / f"isa_{n}.cpp", [], f"{n}.o") for n in ("avx512bf16", "avx2", "portable")]
    units += [(REPO / "benchmarks" / "table_ab_bench.cpp", [], "bench.o")]
    procs = [subprocess.Popen(["g++", *_CXX_FLAGS, *flags, "-c", str(s), "-o", str(out / o)]) for s, flags, o in units]
    if any(p.wait() for p in procs):
        raise RuntimeError("table_ab: compilation failed")
    exe = out / "table_ab_bench"
    subprocess.run(["g++", "-fopenmp", *[str(out / o) for _, _, o in units], "-o", str(exe)], check=True)
    return exe


def run(exe: Path, args: list, threads: int) -> list:
    """The bench's '|' lines (fields as strings), or None where the CPU has no such table."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    lines = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, env=env,
                           check=True).stdout.splitlines()
    if lines and lines[0].startswith("unsupported|"):
        print(f"table_ab: {lines[0].split('|', 1)[1]}; nothing measured")
        return None
    if not lines or lines[-1] != "done":
        raise RuntimeError(f"table_ab_bench {args}: no 'done' line")
    rows = [ln.split("|") for ln in lines[:-1]]
    if any(r[-1] != "1" for r in rows):
        raise RuntimeError(f"table_ab_bench {args}: the two builds' outputs differ")
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="HEAD", help="the git ref whose kernels/csrc is the base build")
    ap.add_argument("--table", choices=("avx512bf16", "avx2"), default=None,
                    help="default: avx512bf16 where this CPU runs it, else avx2")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one round; writes nothing")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {a.rounds}")
    import tonp_kernels as tk
    table = a.table or ("avx512bf16" if tk.isa() == "avx512bf16" else "avx2")
    threads = int(os.environ.get("OMP_NUM_THREADS", "2"))
    meta = machine_meta()
    res = {"hot": [], "hot_bf16": [], "linear": [], "linear_bf16": [], "experts": [], "experts_bf16": []}
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(a.base, Path(tmp))
        for K in ((256,) if a.smoke else (2048, 768)):
            for mode in ("hot", "hot_bf16"):
                got = run(exe, [mode, table, K, 1 if a.smoke else a.rounds], 1)
                if got is None:
                    return {}
                res[mode] += [{"rows": int(r[1]), "K": int(r[2]), "base_GFLOPs": float(r[3]),
                               "new_GFLOPs": float(r[4]), "ratio": float(r[5])} for r in got]
        for mode, shapes in (("linear", LINEAR), ("linear_bf16", LINEAR_BF16)):
            for M, K, N in ([(64, 256, 64)] if a.smoke else shapes):
                r = run(exe, [mode, table, M, K, N, 1 if a.smoke else a.rounds], threads)[0]
                res[mode].append({"shape": f"{M} x {K} x {N}", "base_GFLOPs": float(r[4]), "new_GFLOPs": float(r[5]),
                                  "ratio": float(r[6])})
        for mode in ("experts", "experts_bf16"):
            for mean in (() if a.smoke else (1, 4, 8)):
                for r in run(exe, [mode, table, mean, 2 * a.rounds], threads):
                    res[mode].append({"mean_rows": mean, "base_ms": float(r[2]), "new_ms": float(r[3]),
                                      "probes": [float(r[4]), float(r[5])]})
    def rates(key, keys, digits):  # table rows: the keys' values, base and new GFLOP/s, new / base
        return [[*(x[k] for k in keys), f"{x['base_GFLOPs']:.1f}", f"{x['new_GFLOPs']:.1f}",
                 f"{x['ratio']:.{digits}f}x"] for x in res[key]]
    hot, hot_bf16 = rates("hot", ("rows", "K"), 2), rates("hot_bf16", ("rows", "K"), 2)
    lin, lin_bf16 = rates("linear", ("shape",), 3), rates("linear_bf16", ("shape",), 3)
    exp = []
    for mode, dtype in (("experts", "fp32"), ("experts_bf16", "bf16")):
        for mean in sorted({e["mean_rows"] for e in res[mode]}):
            for state, keep in (("fast", lambda p: min(p) >= FAST), ("slow", lambda p: max(p) < FAST)):
                got = [e for e in res[mode] if e["mean_rows"] == mean and keep(e["probes"])]
                if got:
                    exp.append([dtype, mean, state, len(got), f"{statistics.median(e['base_ms'] for e in got):.1f}",
                                f"{statistics.median(e['new_ms'] for e in got):.1f}",
                                f"{statistics.median(e['base_ms'] / e['new_ms'] for e in got):.3f}x"])
    ref = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", a.base], capture_output=True, text=True)
    base = f"{a.base} ({ref.stdout.strip()})" if ref.returncode == 0 and ref.stdout.strip() != a.base else a.base
    md = [f"# The {table} table against itself at {base} ({meta['date']})", "",
          f"{meta['cpu']}; {threads} threads (hot: one); `benchmarks/table_ab.py`: both builds in one process, "
          "alternated, every output equal byte for byte between them. new / base: the median of the "
          "samples' speed ratios (> 1: the working tree is faster).", "",
          "Hot: four panels in L2, per row count, GFLOP/s (best sample).", "",
          md_table(["rows", "K", "base", "new", "new / base"], hot), "",
          "Hot in bf16 x bf16: two 64-column panels (in L2), per row count, GFLOP/s (best sample).", "",
          md_table(["rows", "K", "base", "new", "new / base"], hot_bf16), "",
          "Whole fp32 linears with weight groups, GFLOP/s (best sample).", "",
          md_table(["M x K x N", "base", "new", "new / base"], lin), "",
          "Whole bf16 x bf16 linears (weights in place), GFLOP/s (best sample).", "",
          md_table(["M x K x N", "base", "new", "new / base"], lin_bf16), ""]
    if exp:
        md += ["The experts' two decode stages, 128 cold experts (weights on 2 MB pages), rows an expert "
               "~ Poisson(mean), fp32 on weight groups and bf16 x bf16 in place; ms, medians per bus state "
               f"(fast: both probes >= {FAST:.0f} GB/s).", "",
               md_table(["dtype", "mean rows", "bus", "samples", "base ms", "new ms", "new / base"], exp), ""]
    text = "\n".join(md)
    print(text)
    if not a.smoke:
        write_record(a.out, "table_ab", text, {"meta": meta, "base": base, "table": table, "threads": threads,
                                               "results": res})
    return res


if __name__ == "__main__":
    main()
