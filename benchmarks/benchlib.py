"""Timing and reporting helpers shared by the model benchmarks and `run_all.py`.

Every comparison in a report is measured in the same process, one after the other, so a ratio is
meaningful even when the machine drifts; absolute numbers on a shared machine are not.

    t = timeit(lambda: f(x), repeat=5, max_total_s=10)   # Timing(seconds=median, runs=5, ...)
    md = md_table(["case", "tok/s"], [["decode", "12.3"]])
    write_results(Path("benchmarks/results"), "latest", md, {"rows": [...]})
"""
from __future__ import annotations

import ctypes
import gc
import json
import os
import platform
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass
class Timing:
    """Seconds per call by `stat` over `runs` timed calls after `warmup_s` of warm-up.

    `note` says when fewer runs than asked were made (a slow call) or when the warm-up itself is
    the only measurement."""
    seconds: float
    runs: int
    warmup_s: float
    samples: List[float] = field(default_factory=list)
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


_STATS = {"median": statistics.median, "min": min}


def timeit(fn: Callable[[], object], *, repeat: int = 3, max_total_s: float = 10.0,
           max_call_s: float = 60.0, stat: str = "median") -> Timing:
    """Time `fn()`: one warm-up call, then up to `repeat` timed calls within `max_total_s`.

    A call slower than `max_call_s` in warm-up is not repeated: the warm-up is then the only
    sample (flagged in `note`), because one more call would blow the run's time budget.
    stat: "median" (default) or "min" (the least disturbed run, for a loaded machine).
    """
    if repeat < 1:
        raise ValueError(f"timeit: repeat must be >= 1, got {repeat}")
    t0 = time.perf_counter()
    fn()
    warm = time.perf_counter() - t0
    if warm > max_call_s:
        return Timing(warm, 1, warm, [warm], note="warm-up only (slow call)")
    n = max(1, min(repeat, int((max_total_s - warm) / max(warm, 1e-9))))
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    note = f"{n} of {repeat} runs (time budget)" if n < repeat else ""
    return Timing(_STATS[stat](samples), n, warm, samples, note)


def timeit_interleaved(fns: Dict[str, Callable[[], object]], *, repeat: int = 3,
                       max_total_s: float = 10.0, max_call_s: float = 60.0,
                       stat: str = "median") -> Dict[str, Timing]:
    """`timeit` for several contenders, run round-robin: one warm-up each, then up to `repeat`
    rounds in which every contender runs once, so a burst of load on a shared machine hits them
    alike and their ratio stays fair. A contender slower than `max_call_s` in warm-up keeps its
    warm-up as its only sample."""
    if repeat < 1:
        raise ValueError(f"timeit_interleaved: repeat must be >= 1, got {repeat}")
    warm = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        warm[name] = time.perf_counter() - t0
    again = [n for n in fns if warm[n] <= max_call_s]
    per_round = sum(warm[n] for n in again)
    rounds = max(1, min(repeat, int((max_total_s - sum(warm.values())) / max(per_round, 1e-9))))
    samples: Dict[str, List[float]] = {n: [] for n in again}
    for _ in range(rounds if again else 0):
        for n in again:
            t0 = time.perf_counter()
            fns[n]()
            samples[n].append(time.perf_counter() - t0)
    out = {}
    for n in fns:
        if n not in samples:
            out[n] = Timing(warm[n], 1, warm[n], [warm[n]], note="warm-up only (slow call)")
        else:
            note = f"{rounds} of {repeat} runs (time budget)" if rounds < repeat else ""
            out[n] = Timing(_STATS[stat](samples[n]), rounds, warm[n], samples[n], note)
    return out


class ForwardClock:
    """Stands in for the model in `tonp_models.generate`: notes each forward's (start, end) in
    `spans` (perf_counter seconds)."""

    def __init__(self, model):
        self.model, self.config, self.spans = model, model.config, []

    def new_cache(self, *args, **kwargs):
        return self.model.new_cache(*args, **kwargs)

    def modules(self):   # the layers whose weight groups the engine keeps (layers/moe.py)
        return self.model.modules()

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.model(*args, **kwargs)
        self.spans.append((t0, time.perf_counter()))
        return out


def summarize(samples: Sequence[float], stat: str = "median") -> float:
    """The chosen statistic of a list of per-step times (seconds)."""
    if not samples:
        raise ValueError("summarize: no samples")
    return _STATS[stat](list(samples))


def cpu_name() -> str:
    """The CPU's model name with its family and model numbers (a VM may show only "AMD EPYC":
    family 25 model 1 is Zen 3, family 25 model 17 Zen 4)."""
    try:
        info = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if not key.strip():
                break                                   # the first processor's block only
            info.setdefault(key.strip(), value.strip())
        if "model name" in info:
            ids = ", ".join(f"{name} {info[key]}" for key, name in
                            (("cpu family", "family"), ("model", "model")) if key in info)
            return info["model name"] + (f" ({ids})" if ids else "")
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_flags() -> List[str]:
    """The SIMD features that decide CPU GEMM speed (avx2, fma, avx512*, amx*)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return sorted(f for f in line.split(":", 1)[1].split()
                              if f in ("avx2", "fma") or f.startswith(("avx512", "amx")))
    except OSError:
        pass
    return []


def kernel_isa() -> str:
    """The kernel table tonp's ops run on this CPU (tonp_kernels.isa(): avx512bf16, avx2,
    portable), or "not built"."""
    try:
        import tonp_kernels
        return tonp_kernels.isa()
    except (ImportError, RuntimeError, AttributeError):
        return "not built"


def machine_meta() -> dict:
    """What a reader needs to judge the numbers: CPU, threads, versions, load average."""
    import transformers
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "cpu_flags": cpu_flags(),
            "isa": kernel_isa(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "load_before": os.getloadavg()[0]}


def busy_warning(meta: dict) -> str:
    """A loud line when the machine was already busy before the run. (The load average after
    the run includes the benchmark's own threads, so it cannot tell other work apart.)"""
    load = meta.get("load_before", 0.0)
    if load > (meta.get("cores") or 1):
        return (f"**The machine was busy (load average {load:.1f} on {meta['cores']} cores): "
                f"absolute numbers are unreliable; re-run `make bench` on a quiet machine.**")
    return ""


def free_memory() -> None:
    """Release dropped models now (large tensors can otherwise linger until the next gc), and the
    idle blocks tonp's memory pool keeps for the next call (up to TONP_POOL_MB, 4 GB by default)."""
    gc.collect()
    release = getattr(getattr(torch.ops, "tonp", None), "release_memory_pool", None)
    if release is not None:
        release()
    try:  # glibc: hand free heap pages back (its mmap threshold rises after large frees)
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def fmt(v: Optional[float], digits: int = 1) -> str:
    if v is None:
        return "n/a"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}f}"


def fmt_ratio(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality; floating NaNs compared by position (payloads are the device's)."""
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        na, nb = a.isnan(), b.isnan()
        return torch.equal(na, nb) and torch.equal(a[~na], b[~nb])
    return torch.equal(a, b)


def md_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table (cells converted with str)."""
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def write_results(out_dir: Path, stem: str, md: str, data: dict) -> List[Path]:
    """Write `<stem>.md` and `<stem>.json` under out_dir; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md_path, json_path = out_dir / f"{stem}.md", out_dir / f"{stem}.json"
    md_path.write_text(md)
    json_path.write_text(json.dumps(data, indent=1, default=_json_default) + "\n")
    return [md_path, json_path]


def machine_slug(meta: dict) -> str:
    """A short name for the machine kind of a run's meta: intel_xeon, amd_epyc, ... with the
    kernel table appended unless it is avx512bf16 (amd_epyc_avx2): the results' naming."""
    cpu = str(meta.get("cpu", "")).lower()
    vendor = ("intel_xeon" if "xeon" in cpu else "amd_epyc" if "epyc" in cpu else
              "_".join(re.findall(r"[a-z0-9]+", cpu.split("(")[0])[:2]) or "cpu")
    isa = str(meta.get("isa") or "")
    return vendor + ("" if isa in ("", "avx512bf16") else "_" + isa)


def _same_machine(path: Path, meta: dict) -> bool:
    try:
        old = json.loads(path.read_text()).get("meta", {})
    except (OSError, ValueError, AttributeError):
        return False
    return old.get("cpu") == meta.get("cpu") and old.get("isa") == meta.get("isa")


def record_stem(out_dir: Path, stem: str, meta: dict) -> str:
    """Where a machine's record of `stem` goes: `stem` itself unless `stem.json` holds another
    machine's run (another CPU model or kernel table), then `stem_<machine_slug>`, then that
    with the CPU's family and model: a run never overwrites another machine's record."""
    slug = machine_slug(meta)
    fm = re.search(r"family (\d+), model (\d+)", str(meta.get("cpu", "")))
    names = [stem, f"{stem}_{slug}"] + ([f"{stem}_{slug}_f{fm[1]}m{fm[2]}"] if fm else [])
    for name in names:
        path = out_dir / f"{name}.json"
        if not path.exists() or _same_machine(path, meta):
            return name
    return names[-1]


def write_record(out_dir: Path, stem: str, md: str, data: dict) -> List[Path]:
    """write_results under record_stem(out_dir, stem, data["meta"]) (per-machine records:
    kernels, batched decode)."""
    return write_results(out_dir, record_stem(out_dir, stem, data.get("meta", {})), md, data)


def _json_default(o):
    if isinstance(o, (torch.dtype, Path)):
        return str(o)
    if hasattr(o, "to_dict"):
        return o.to_dict()
    raise TypeError(f"not JSON serialisable: {type(o)}")


def log(msg: str) -> None:
    """Progress on stdout, flushed (runs are long; the user wants to see where they are)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


_CXX_FLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-fno-fast-math", "-falign-loops=64", "-fopenmp"]  # setup.py's


def build_kernel_bench(source: str, out_dir: Path) -> Path:
    """A C++ microbenchmark (benchmarks/<source>.cpp) linked with the torch-free kernel tables
    (kernels/csrc/isa_*.cpp), compiled with the extension's flags, objects in parallel; returns
    the executable in out_dir."""
    import subprocess
    root = Path(__file__).resolve().parent.parent
    srcs = sorted((root / "kernels" / "csrc").glob("isa_*.cpp")) + [
        root / "benchmarks" / f"{source}.cpp"]
    objs = [str(out_dir / (s.stem + ".o")) for s in srcs]
    procs = [subprocess.Popen(["g++", *_CXX_FLAGS, "-c", str(s), "-o", o])
             for s, o in zip(srcs, objs)]
    if any(p.wait() for p in procs):
        raise RuntimeError(f"{source}: compilation failed")
    exe = out_dir / source
    subprocess.run(["g++", "-fopenmp", *objs, "-o", str(exe)], check=True)
    return exe
