"""The GPU check of tonp's Triton kernels: one script, one call on a lent GPU (an H200), < 8 min.

    python3 benchmarks/gpu_check.py [--budget 460] [--out benchmarks/results]   # `make gpu-check`
    python3 benchmarks/gpu_check.py --dry-run --out /tmp/x     # CPU: interpreter, tiny sizes

It builds the C++ extension against the machine's own torch (no downloads: `setup.py build_ext
--inplace`, the import name `tonp_kernels` linked to kernels/), then runs sections, each in its
own time budget: exact kernels == the CPU's bits (every op, the tiny model's forward, decode and
sampled generate); fast-mode invariances (rows alone vs in a batch, split, TP row/column shards,
prefill vs decode, EP, and end to end: training logprobs == rollout logprobs); timings as ratios
measured in the same run (decode linear vs a device copy, M=4096 GEMM vs torch.matmul, the
30B-shaped 2-layer decode step vs torch mode, exact GEMM vs the fp32 peak; the experts'
backward as grouped Triton GEMMs vs the CPU op and vs a per-expert loop; a tile sweep). A
failing section is recorded with its error and the run goes on. It writes gpu.json and gpu.md
(and copies them to $OUT when that folder exists: the device tool brings $OUT back).

--dry-run routes CPU tensors through Triton's interpreter at tiny sizes: every section runs,
nothing is timed (tests/test_triton_fast_gpu_check.py runs it, so the script cannot rot).
docs/accelerators.md ("The GPU check") says what each section verifies and how the targets are
measured.
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if "--dry-run" in sys.argv:  # before anything imports triton: the kernels are then interpreted
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from benchlib import md_table, write_results  # noqa: E402


class NotAvailable(Exception):
    """A section needs something this tree or machine does not have (e.g. the dispatch)."""


class SectionTimeout(Exception):
    pass


class Section:
    """What one section found: checks (bits equal or not), metrics (with targets), notes."""

    def __init__(self, name: str, budget_s: float, dry: bool, device: str):
        self.name, self.budget_s, self.dry, self.device = name, budget_s, dry, device
        self.start = time.time()
        self.status, self.error = "ok", None
        self.checks, self.metrics, self.notes = [], [], []

    def check(self, what: str, equal: bool, detail: str = "") -> bool:
        self.checks.append({"check": what, "equal": bool(equal), "detail": detail})
        return bool(equal)

    def metric(self, what: str, value, unit: str = "", target: str = "", met=None, note=""):
        """A measured value (None in a dry run); target like '>= 0.70' and met: True/False."""
        self.metrics.append({"metric": what, "value": value, "unit": unit, "target": target,
                             "met": met, "note": note})

    def note(self, text: str) -> None:
        self.notes.append(text)

    def left_s(self) -> float:
        return self.budget_s - (time.time() - self.start)

    def to_dict(self) -> dict:
        return {"name": self.name, "status": self.status, "error": self.error,
                "seconds": round(time.time() - self.start, 2), "checks": self.checks,
                "metrics": self.metrics, "notes": self.notes}


def _alarm(_sig, _frame):
    raise SectionTimeout()


def _timed_out(e: BaseException) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, SectionTimeout):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def run_section(name, fn, budget_s, args, deadline) -> dict:
    dev = "cpu" if args.dry_run else "cuda"
    sec = Section(name, min(budget_s, max(0.0, deadline - time.time())), args.dry_run, dev)
    if sec.budget_s < 1:
        sec.status = "skipped: the run's time budget is spent"
        return sec.to_dict()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, sec.budget_s)
    try:
        fn(sec)
    except NotAvailable as e:
        sec.status, sec.error = "not available", str(e)
    except Exception as e:  # noqa: BLE001 - a failing section is recorded, the run goes on
        if _timed_out(e):   # the interpreter wraps the alarm raised inside a kernel it runs
            sec.status, sec.error = "timeout", f"stopped after its budget of {sec.budget_s:.0f} s"
        else:
            sec.status = "error"
            sec.error = f"{type(e).__name__}: {e}\n" + "".join(traceback.format_exc()[-1500:])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    if sec.status == "ok" and not all(c["equal"] for c in sec.checks):
        sec.status = "differs"
    d = sec.to_dict()
    print(f"[gpu_check] {name}: {d['status']} in {d['seconds']} s "
          f"({sum(c['equal'] for c in sec.checks)}/{len(sec.checks)} checks equal)", flush=True)
    return d


# ---------------------------------------------------------------------------------------------
# The build: the C++ extension against this machine's torch, and the import name
# ---------------------------------------------------------------------------------------------
def _importable() -> bool:
    """tonp_kernels is on the path with an extension built for this Python (not imported yet:
    importing it without its extension would leave it without its C++ ops)."""
    spec = importlib.util.find_spec("tonp_kernels")
    return spec is not None and any(
        (Path(d) / f"_C{suffix}").exists() for d in spec.submodule_search_locations or ()
        for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def build(sec: Section) -> None:
    """Make `import tonp_kernels` work here: as installed, or built in place and linked."""
    if _importable():
        sec.note("tonp_kernels (with its C++ extension) is importable as installed")
        return
    shim = Path(tempfile.mkdtemp(prefix="tonp_shim_"))
    (shim / "tonp_kernels").symlink_to(ROOT / "kernels", target_is_directory=True)
    sys.path[:0] = [str(shim), str(ROOT)]
    importlib.invalidate_caches()
    if not _importable():
        t = time.time()
        proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=ROOT,
                              capture_output=True, text=True, timeout=max(10, sec.left_s() - 5))
        sec.note(f"setup.py build_ext --inplace: {time.time() - t:.0f} s, rc {proc.returncode}")
        if proc.returncode:
            raise RuntimeError("the C++ build failed:\n" + proc.stdout[-800:] + proc.stderr[-1500:])
    importlib.invalidate_caches()
    import tonp_kernels
    isa = tonp_kernels.isa()  # the host CPU's table: bits never depend on it (CONTRACT.md)
    sec.check("tonp_kernels imports with its C++ ops", isa in ("avx512bf16", "avx2", "portable"),
              f"(table {isa})")
    sec.note(f"host CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
             f"C++ kernel table {isa}")


def environment(sec: Section) -> None:
    import triton
    sec.note(f"python {platform.python_version()}, torch {torch.__version__}, triton "
             f"{triton.__version__}, dry run: {sec.dry}")
    if not sec.dry:
        p = torch.cuda.get_device_properties(0)
        sec.note(f"{p.name}: {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB, "
                 f"capability {p.major}.{p.minor}, CUDA {torch.version.cuda}")
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True)
    sec.note(f"tree: {rev.stdout.strip() or 'no git metadata'}")


def sections() -> list:
    """(name, function, budget in seconds) of every section after the build, in run order."""
    import gpu_sections as s  # these import tonp_kernels: only once the build made it importable
    import gpu_timing as t
    # The 30B-shaped decode step last: its first calls compile the most kernels (the first H200
    # run spent > 90 s there), and the run's deadline cuts only what comes after it.
    return [("exact ops vs CPU", s.exact_ops, 180),
            ("fast kernels: invariances", s.fast_kernels, 60),
            ("fast kernels: invariances at the tiny model's shapes", s.fast_kernels_tiny, 60),
            ("exact model vs CPU", s.exact_model, 60),
            ("fast model: train == rollout", s.fast_model, 150),
            ("timing: decode linear vs copy", t.decode_linear, 60),
            ("timing: GEMM M=4096 vs torch.matmul", t.gemm_4096, 40),
            ("timing: exact GEMM vs fp32 peak", t.exact_gemm, 30),
            ("experts' backward: grouped vs CPU, timed vs per-expert loop", t.moe_backward, 40),
            ("timing: tile sweep (layout only)", t.config_sweep, 60),
            ("timing: 30B-shaped decode step, fast vs torch mode", t.model_decode, 150)]


def chosen(all_sections: list, only: str) -> list:
    """The sections `--only` names by prefixes, in its order (all of them when it is empty)."""
    prefixes = [p.strip() for p in only.split(",") if p.strip()]
    if not prefixes:
        return all_sections
    picked = []
    for p in prefixes:
        hits = [sec for sec in all_sections if sec[0].startswith(p) and sec not in picked]
        if not hits:
            raise SystemExit(f"--only: no section starts with {p!r}; sections: "
                             + "; ".join(sec[0] for sec in all_sections))
        picked += hits
    return picked


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------
def _fmt(v) -> str:
    return "-" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))


def markdown(results: list, meta: dict) -> str:
    lines = ["# GPU check (benchmarks/gpu_check.py)", "",
             f"{meta['when']}; {'DRY RUN (CPU, interpreter): nothing measured' if meta['dry'] else 'measured on the GPU named below'}; "
             f"{meta['seconds']:.0f} s in all.", ""]
    lines.append(md_table(["section", "status", "s", "checks equal"],
                          [[r["name"], r["status"], r["seconds"],
                            f"{sum(c['equal'] for c in r['checks'])}/{len(r['checks'])}"]
                           for r in results]))
    targets = [(r["name"], m) for r in results for m in r["metrics"] if m["target"]]
    if targets:
        lines += ["", "## Targets", "", md_table(
            ["section", "metric", "value", "target", "met"],
            [[n, m["metric"], f"{_fmt(m['value'])} {m['unit']}".strip(), m["target"],
              {True: "yes", False: "NO", None: "-"}[m["met"]]] for n, m in targets])]
    for r in results:
        lines += ["", f"## {r['name']}: {r['status']}"]
        if r["notes"]:
            lines += [""] + [f"- {n}" for n in r["notes"]]
        if r["error"]:
            lines += ["", "```", r["error"].strip(), "```"]
        bad = [c for c in r["checks"] if not c["equal"]]
        if r["checks"]:
            lines += ["", f"{len(r['checks']) - len(bad)} of {len(r['checks'])} checks equal"
                      + ("; differing:" if bad else ".")]
            lines += [f"- {c['check']} {c['detail']}".rstrip() for c in bad]
        others = [m for m in r["metrics"] if not m["target"]]
        if others:
            lines += ["", md_table(["metric", "value", "note"],
                                   [[m["metric"], f"{_fmt(m['value'])} {m['unit']}".strip(),
                                     m["note"]] for m in others])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU tensors through the interpreter")
    ap.add_argument("--budget", type=float, default=460.0, help="seconds for the whole run")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for gpu.json / gpu.md (default benchmarks/results; a dry run "
                         "needs one)")
    ap.add_argument("--only", default="",
                    help="comma-separated prefixes of section names: those sections, in this "
                         "order")
    args = ap.parse_args(argv)
    if args.dry_run and args.out is None:
        ap.error("--dry-run needs --out (benchmarks/results/gpu.md holds GPU measurements only)")
    out = args.out or ROOT / "benchmarks" / "results"
    t0 = time.time()
    deadline = t0 + args.budget
    results = [run_section("environment", environment, 10, args, deadline),
               run_section("build", build, 240, args, deadline)]
    if results[-1]["status"] == "ok":
        # a dry run measures nothing, it shows every section runs: on the CPU's interpreter,
        # whose speed varies several-fold between machine kinds, only the run's --budget bounds
        # a section; on the device each section keeps its own budget
        for name, fn, budget in chosen(sections(), args.only):
            results.append(run_section(name, fn, args.budget if args.dry_run else budget,
                                       args, deadline))
    meta = {"when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "dry": args.dry_run,
            "seconds": time.time() - t0, "argv": sys.argv[1:]}
    paths = write_results(out, "gpu", markdown(results, meta), {"meta": meta,
                                                                 "sections": results})
    dest = os.environ.get("OUT")
    if dest and os.path.isdir(dest) and Path(dest).resolve() != out.resolve():
        for p in paths:
            shutil.copy(p, dest)
    print(f"[gpu_check] wrote {', '.join(map(str, paths))} in {meta['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
