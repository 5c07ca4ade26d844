"""Collective benchmark: tonp's fixed-order all-reduce against the backend's `dist.all_reduce`.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/collectives.py [--worlds 2 4] [--quick]

Spawns gloo worlds of 2 and 4 CPU processes (one thread each) and times, in the same run,
`dist.all_reduce` (the baseline) and `tonp_parallel.tree_all_reduce` in each wire form
("gather": all_gather + local tree; "all_to_all": all_to_all of chunks + tree + all_gather;
"auto": the form tonp picks by size) for a decode-sized (1 x 2048 fp32, 8 KiB) and a
training-sized (4096 x 2048 fp32, 32 MiB) message. Each timing is the median over repeats of
the slowest rank, after a barrier and a warm-up; the forms take turns within each repeat. "sent/rank" is the payload each rank sends by
the algorithm's definition (W ranks, n bytes): ring all-reduce 2(W-1)/W n; all_gather
(W-1) n; all_to_all + all_gather 2(W-1)/W n. Whether gloo's bits equal the fixed tree is
reported too. Prints a markdown table and writes benchmarks/results/collectives.md.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import tonp_parallel as tpar
from tonp_parallel.launch import run_distributed

ROOT = Path(__file__).resolve().parents[1]

MESSAGES = (("decode 1x2048", (1, 2048)), ("training 4096x2048", (4096, 2048)))
FORMS = ("dist.all_reduce", "tree auto", "tree gather", "tree all_to_all")


def _sent_bytes(form: str, W: int, n_bytes: int, auto_form: str) -> float:
    if form == "tree auto":
        form = f"tree {auto_form}"
    if form == "tree gather":
        return (W - 1) * n_bytes
    return 2 * (W - 1) / W * n_bytes  # ring all-reduce, and all_to_all + all_gather


def _bench_rank(shape, repeats: int):
    """One rank: median seconds per form (slowest rank per repeat), and whether gloo == tree."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(shape, generator=g) * 10.0 ** torch.randint(0, 6, shape, generator=g)
    calls = {
        "dist.all_reduce": lambda: dist.all_reduce(x.clone()),
        "tree auto": lambda: tpar.tree_all_reduce(x, dist.group.WORLD),
        "tree gather": lambda: tpar.tree_all_reduce(x, dist.group.WORLD, algorithm="gather"),
        "tree all_to_all": lambda: tpar.tree_all_reduce(x, dist.group.WORLD,
                                                        algorithm="all_to_all"),
    }
    # The clone is part of the baseline because dist.all_reduce works in place and the caller
    # must keep its partial; tree_all_reduce returns a new tensor.
    for fn in calls.values():
        fn()  # warm-up (connections, allocator)
    # Forms take turns within every repeat, so a load spike on the host hits them all alike.
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[name].append(float(t))
    out = {name: statistics.median(ts) for name, ts in times.items()}
    y = x.clone()
    dist.all_reduce(y)
    out["gloo == tree"] = torch.equal(y, tpar.tree_all_reduce(x, dist.group.WORLD))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    args = ap.parse_args()
    rows = []
    for W in args.worlds:
        for label, shape in MESSAGES:
            n_bytes = 4 * shape[0] * shape[1]
            big = n_bytes > 1 << 20
            repeats = (3 if args.quick else 5) if big else (20 if args.quick else 100)
            res = run_distributed(_bench_rank, W, shape, repeats, timeout=900)[0]
            auto_form = "gather" if n_bytes <= tpar.SMALL_MESSAGE_BYTES else "all_to_all"
            base = res["dist.all_reduce"]
            for form in FORMS:
                sent = _sent_bytes(form, W, n_bytes, auto_form)
                name = f"tree auto ({auto_form})" if form == "tree auto" else form
                rows.append((W, label, name, sent, res[form], res[form] / base,
                             res["gloo == tree"] if form == "dist.all_reduce" else True))
            print(f"world {W}, {label}: done", file=sys.stderr)

    def fmt_bytes(b):
        return f"{b / 2**20:.2f} MiB" if b >= 2**20 else f"{b / 2**10:.1f} KiB"

    lines = [
        f"# Fixed-order all-reduce vs dist.all_reduce (gloo, {time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}, one thread "
        f"per rank, ranks on one host (loopback). SMALL_MESSAGE_BYTES = "
        f"{tpar.SMALL_MESSAGE_BYTES}. Time: median over repeats of the slowest rank. "
        f"ratio = time / dist.all_reduce time in the same run. 'bits = tree': whether the "
        f"result equals the contract's fixed tree (tonp's forms always do, by construction).",
        "",
        "| world | message | form | sent/rank | time (ms) | ratio vs dist.all_reduce | bits = tree |",
        "|---|---|---|---|---|---|---|",
    ]
    for W, label, form, sent, t, ratio, same in rows:
        lines.append(f"| {W} | {label} | {form} | {fmt_bytes(sent)} | {t * 1e3:.3f} | "
                     f"{ratio:.2f}x | {'yes' if same else 'no'} |")
    table = "\n".join(lines) + "\n"
    print(table)
    out = ROOT / "benchmarks" / "results" / "collectives.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table)
    print(f"wrote {out.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
