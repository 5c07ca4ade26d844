"""`make bench`: where tonp stands against stock torch, transformers and the machine's limits.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/run_all.py           # full run (~15 min, 2 cores)
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/run_all.py --quick   # tiny model only (~1-2 min)
    ... run_all.py --models 30B --dtypes bf16 --skip-kernels --skip-collectives   # one slice
    ... run_all.py --render-only benchmarks/results/latest.json   # rebuild a stored report

Writes benchmarks/results/latest.{md,json,png} (--quick: latest_quick.*): the machine's limits
(roofline.py), rollout and training throughput of tonp "invariant", tonp "torch" mode and
transformers for each model and dtype (model_bench.py), every comparison as a ratio measured side
by side in this run, each tonp figure as a fraction of the bound that limits it, the targets
(met / NOT met), torch.profiler tables of the largest costs where a target is missed, and
the kernel (kernel_bench.py), collective (collectives.py), rollout-service (serve_bench.py) and
pipeline / context parallelism (parallel_bench.py) and training-speed (train_bench.py)
tables, run as subprocesses.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, when run as a script

import model_bench as mb  # noqa: E402
import roofline  # noqa: E402
import tonp_kernels.amx as amx  # noqa: E402
from benchlib import (RESULTS_DIR, busy_warning, fmt, fmt_ratio, free_memory, log,  # noqa: E402
                    machine_meta, md_table, record_stem, write_results)

BYTES = {"fp32": 4, "bf16": 2}
METRICS = ("decode_b1", "decode_b16", "prefill", "train")
PEERS = (("Kernels (benchmarks/kernel_bench.py)", "kernels_quick.md"),
         ("Collectives (benchmarks/collectives.py)", "collectives.md"),
         ("Rollout service (benchmarks/serve_bench.py)", "serve_quick.md"),
         ("Pipeline and context parallelism (benchmarks/parallel_bench.py)", "parallel.md"))
LABELS = {"decode_b1": "decode, batch 1", "decode_b16": "decode, batch 16",
          "prefill": "prefill", "train": "training fwd+bwd"}


# ---------------------------------------------------------------------------------------------
# Bounds and targets
# ---------------------------------------------------------------------------------------------
def bound_tok_s(case: mb.Case, dtype: str, metric: str, m: dict, machine: dict) -> float:
    """The roofline tokens/s of a measurement: memory-bound decode, compute-bound prefill and
    training (see roofline.py)."""
    c = case.config
    if metric.startswith("decode"):  # the bandwidth probed beside the steps (older runs: the machine's)
        return roofline.decode_bound_tok_s(c, m.get("read_GBs", machine["read_GBs"]), BYTES[dtype],
                                           m["batch"], m["context"])
    L = getattr(case, metric)[1]
    return roofline.compute_bound_tok_s(c, machine, (L + 1) / 2, training=metric == "train")


def targets(case: mb.Case, dtype: str, res: dict, machine: dict) -> list:
    """The performance targets that apply to this case and dtype: dicts with what, measured, met."""
    inv, tor, hf = res["tonp invariant"], res["tonp torch"], res["transformers"]
    out = []

    def add(what, metric, value, ok, shown):
        out.append({"case": case.name, "dtype": dtype, "target": what, "metric": metric,
                    "value": value, "met": bool(ok), "measured": shown})
    for metric in [k for k in METRICS if k.startswith("decode")]:
        r = inv[metric]["step_s"] / tor[metric]["step_s"]
        if dtype == "fp32":
            add("invariant decode time <= 1.10x torch mode", metric, r, r <= 1.10,
                f"{r:.2f}x the time")
        else:
            add("invariant decode faster than torch mode", metric, r, r < 1.0,
                f"{r:.2f}x the time")
        s = inv[metric]["tok_s"] / hf[metric]["tok_s"]
        hf_frac = hf[metric]["tok_s"] / bound_tok_s(case, dtype, metric, hf[metric], machine)
        add("invariant decode tok/s >= 3x transformers", metric, s, s >= 3.0, f"{s:.2f}x"
            + (f" (transformers is at {100 * hf_frac:.0f}% of the memory bound: 3x would "
               f"exceed the bound)" if s < 3.0 and hf_frac > 1 / 3 else ""))
    if dtype == "fp32":
        r = inv["train"]["step_s"] / tor["train"]["step_s"]
        add("invariant training step <= 1.3x torch mode", "train", r, r <= 1.3,
            f"{r:.2f}x the time")
    if case.bandwidth_target:
        f = inv["decode_b1"]["tok_s"] / bound_tok_s(case, dtype, "decode_b1", inv["decode_b1"],
                                                    machine)
        add("batch-1 decode >= 60% of the memory-bandwidth bound", "decode_b1", f, f >= 0.6,
            f"{100 * f:.0f}% of bound")
    return out


def checks_and_profiles(machine: dict, profile: bool, store: dict):
    """The `on_tonp` hook of model_bench.bench_case: targets, then profiles of the missed ones
    while the tonp model is still loaded."""
    def hook(case, dtype, model, res):
        found = targets(case, dtype, res, machine)  # final ones: all_targets, after the run
        if not profile:
            return
        missed = {t["metric"]: t for t in found if not t["met"]}
        for metric in missed:
            # Decode: tonp torch mode beside invariant when a torch-mode target is missed.
            # Training: invariant only (a training step of the big model is the costliest call).
            vs_torch = any("torch mode" in t["target"] for t in found
                           if t["metric"] == metric and not t["met"])
            modes = ["invariant"] + (["torch"] if vs_torch and metric != "train" else [])
            for mode in modes:
                log(f"  profiling {case.name} {dtype} {metric} ({mode})")
                if metric == "train":
                    p = mb.profile_train(model, case, mode)
                else:
                    p = mb.profile_decode(model, case, int(metric.split("_b")[1]), mode)
                store.setdefault("profiles", []).append(
                    {"case": case.name, "dtype": dtype, "metric": metric, "mode": mode, **p})
    return hook


def all_targets(cases, runs, machine) -> list:
    return [t for case, run in zip(cases, runs) for dtype, res in run["results"].items()
            for t in targets(case, dtype, res, machine)]


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def case_table(case: mb.Case, run: dict, machine: dict) -> str:
    rows = []
    for dtype, res in run["results"].items():
        inv, tor, hf = res["tonp invariant"], res["tonp torch"], res["transformers"]
        for metric in METRICS:
            if metric not in inv:
                continue
            b = bound_tok_s(case, dtype, metric, inv[metric], machine)
            rows.append([LABELS[metric], dtype, fmt(inv[metric]["tok_s"]),
                         fmt(tor[metric]["tok_s"]), fmt(hf[metric]["tok_s"]),
                         fmt_ratio(inv[metric]["tok_s"] / tor[metric]["tok_s"]),
                         fmt_ratio(inv[metric]["tok_s"] / hf[metric]["tok_s"]),
                         f"{fmt(b)} ({_bound_kind(metric, inv[metric])})",
                         _pct(inv[metric]["tok_s"] / b), _pct(tor[metric]["tok_s"] / b)])
    return md_table(["measurement", "dtype", "tonp invariant tok/s", "tonp torch tok/s",
                     "transformers tok/s", "invariant / torch", "invariant / transformers",
                     "bound tok/s", "invariant % of bound", "torch % of bound"], rows)


def _bound_kind(metric: str, m: dict) -> str:
    if not metric.startswith("decode"):
        return "compute"
    return f"memory, {m['read_GBs']:.1f} GB/s" if "read_GBs" in m else "memory"


def _pct(f: float) -> str:
    return f"{100 * f:.0f}%" if f >= 0.1 else f"{100 * f:.2g}%"


def markdown(meta, machine, cases, runs, store, extra) -> str:
    flag = "" if meta["mode"] == "full" else f", --{meta['mode']}"
    out = [f"# tonp benchmarks ({meta['date']}{flag})",
           "",
           f"{meta['cpu']} ({', '.join(meta['cpu_flags']) or 'no AVX flags'}), kernel table "
           f"**{meta['isa']}**, {meta['threads']} "
           f"threads, torch {meta['torch']}, transformers {meta['transformers']}; load average "
           f"{meta['load_before']:.1f} before, {meta['load_after']:.1f} after. Every ratio is "
           f"measured side by side in this run; absolute numbers drift with the machine's load.",
           ""]
    warn = busy_warning(meta)
    if warn:
        out += [warn, ""]
    out += ["## Targets", ""]
    rows = [[t["target"], t["case"], t["dtype"], LABELS[t["metric"]], t["measured"],
             "met" if t["met"] else "**NOT met**"] for t in store.get("targets", [])]
    if not rows:
        rows = [["(no tonp results)", "", "", "", "", ""]]
    out += [md_table(["target", "model", "dtype", "measurement", "measured", "status"], rows), ""]
    out += ["## Machine limits (roofline)", "",
            f"Read-only bandwidth (x.sum() or x.dot(x) over "
            f"{machine['bandwidth_bytes'] / 2**20:.0f} MiB) "
            f"**{machine['read_GBs']:.2f} GB/s**; copy bandwidth (read + write) "
            f"{machine['copy_GBs']:.2f} GB/s; fp32 GEMM ({machine['gemm_n']}^3, the faster of "
            f"MKL's torch.mm and tonp's backward GEMM) "
            f"**{machine['gemm_fp32_GFLOPs']:.1f} GFLOP/s**: the best of a few runs each, "
            f"{len(machine.get('measurements', [machine]))} measurements (during the run"
            f"{' and when this report was re-rendered' if meta.get('rendered') else ''}), the "
            f"best kept.",
            "Decode is bounded by the active weights it streams (attention, router, top-k "
            "experts, LM head; batch 16: experts expected under uniform routing) plus its KV "
            "reads, over the read bandwidth probed between that measurement's repeats (the "
            "median probe, shown in the bound column: a neighbour's load on this shared machine "
            "moves the bandwidth by tens of percent within a run); prefill and training by "
            "FLOPs per token over the fp32 GEMM rate (bf16 too, held to the fp32 bound: on a "
            "CPU with AVX512-BF16 its pair chains can run above it).", ""]
    for case, run in zip(cases, runs):
        c = case.config
        info = run["info"]
        out += [f"## Model: {case.name}", "",
                f"{case.summary()}; {info['params'] / 1e6:.1f} M parameters "
                f"({info['params'] * 4 / 2**30:.2f} GiB fp32). transformers: attention "
                f"`{info.get('hf_attention')}`, experts `{info.get('hf_experts')}`, DynamicCache. "
                f"Measured round-robin: {info.get('round_robin', 'no (one engine at a time)')}. "
                f"Decode: prompts of {case.prompt_len} tokens, "
                + ", ".join(f"batch {b}: {n - 1} decode steps x {case.repeat} calls"
                            for b, n in case.decode.items())
                + f" (median step); prefill {case.prefill[0]} x {case.prefill[1]} tokens; "
                f"training {case.train[0]} x {case.train[1]} tokens (median of up to "
                f"{case.repeat} runs). Active weights per batch-1 decode step: "
                f"{roofline.active_weight_bytes(c, 4) / 2**20:.1f} MiB fp32; forward "
                f"{roofline.flops_per_token(c, (case.prefill[1] + 1) / 2) / 1e6:.1f} MFLOP "
                f"per prefill token.", "",
                "Throughput in tokens/s (higher is better); ratios > 1 mean tonp invariant is "
                "faster.", "", case_table(case, run, machine), ""]
        profs = [p for p in store.get("profiles", []) if p["case"] == case.name]
        if profs:
            out += ["### Largest costs where a target is missed (torch.profiler, self CPU time)",
                    ""]
        for p in profs:
            out += [f"**{p['dtype']} {LABELS[p['metric']]}, tonp {p['mode']}**: "
                    f"{p['wall_ms_per_step']:.1f} ms per step under the profiler (ops' self "
                    f"time {p['self_ms_per_step']:.1f} ms).", "",
                    md_table(["op", "costliest input shapes (its share of the op)", "calls/step",
                              "ms/step", "share of op time"],
                             [[r["op"], f"`{r['shapes']}` ({100 * r['top_shape_share']:.0f}%)"
                               if r["shapes"] else "", f"{r['calls_per_step']:.0f}",
                               f"{r['ms_per_step']:.2f}", f"{100 * r['share']:.0f}%"]
                              for r in p["top"]]), ""]
    for title, text in extra:
        out += [f"## {title}", "", _demote(text), ""]
    return "\n".join(out)


def _demote(md: str) -> str:
    """Nest another report's headings under this one's sections."""
    return "\n".join("##" + line if line.startswith("#") else line for line in md.splitlines())


def chart(path: Path, cases, runs, machine) -> bool:
    """Two panels: speed relative to tonp torch mode (invariant, transformers), and tonp
    invariant as a fraction of its roofline bound."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels, inv_rel, hf_rel, frac = [], [], [], []
    for case, run in zip(cases, runs):
        for dtype, res in run["results"].items():
            for metric in METRICS:
                inv, tor, hf = (res[e][metric] for e in ("tonp invariant", "tonp torch",
                                                         "transformers"))
                labels.append(f"{case.name.split(',')[0]}\n{dtype}\n{metric.replace('_', ' ')}")
                inv_rel.append(inv["tok_s"] / tor["tok_s"])
                hf_rel.append(hf["tok_s"] / tor["tok_s"])
                frac.append(inv["tok_s"] / bound_tok_s(case, dtype, metric, inv, machine))
    fig, (a, b) = plt.subplots(2, 1, figsize=(max(8, 0.8 * len(labels)), 8))
    x = range(len(labels))
    a.bar([i - 0.2 for i in x], inv_rel, 0.4, label="tonp invariant")
    a.bar([i + 0.2 for i in x], hf_rel, 0.4, label="transformers")
    a.axhline(1.0, color="k", lw=0.8)
    a.set_yscale("log")
    a.set_ylabel("tokens/s relative to tonp torch mode")
    a.legend()
    b.bar(list(x), [100 * f for f in frac], 0.6, color="tab:green")
    b.axhline(60, color="r", lw=0.8, ls="--")
    b.set_ylabel("tonp invariant, % of roofline bound")
    for ax in (a, b):
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------------
# Peer benchmarks (other files of benchmarks/), run as subprocesses
# ---------------------------------------------------------------------------------------------
def run_peer(script: str, args: list, md_name: str, timeout: int):
    """Run benchmarks/<script> and return (title, markdown it wrote) or None."""
    here = Path(__file__).resolve().parent
    if not (here / script).exists():
        return None
    log(f"running {script} {' '.join(args)}")
    try:
        p = subprocess.run([sys.executable, str(here / script), *args], capture_output=True,
                           text=True, timeout=timeout, cwd=here.parent)
    except subprocess.TimeoutExpired:
        return script, f"`{script}` did not finish within {timeout} s."
    md = RESULTS_DIR / md_name
    if p.returncode != 0 or not md.exists():
        tail = (p.stdout + p.stderr).strip().splitlines()[-15:]
        return script, f"`{script}` failed (exit {p.returncode}):\n\n```\n" + "\n".join(tail) \
            + "\n```"
    return script, md.read_text()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model only, few steps (~1-2 min)")
    ap.add_argument("--smoke", action="store_true", help="1-layer tiny model, one repeat: "
                    "checks that the code runs (tests)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="statistic over repeats/steps (min resists a loaded machine)")
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=None,
                    help="profile missed targets (default: on, off with --quick/--smoke)")
    ap.add_argument("--dtypes", nargs="+", choices=tuple(mb.DTYPES), default=list(mb.DTYPES))
    ap.add_argument("--models", nargs="+", metavar="PREFIX",
                    help="only the models whose name starts with one of these (e.g. tiny, 30B)")
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--kernels-full", action="store_true",
                    help="run kernel_bench.py at full size (default: its --quick, for time)")
    ap.add_argument("--skip-collectives", action="store_true")
    ap.add_argument("--skip-serve", action="store_true")
    ap.add_argument("--skip-parallel", action="store_true",
                    help="skip parallel_bench.py (PP / CP against PP 1 / CP 1)")
    ap.add_argument("--skip-train", action="store_true",
                    help="skip train_bench.py (training step vs forward and torch)")
    ap.add_argument("--skip-amx", action="store_true",
                    help="skip benchmarks/amx_bench.py (run where the CPU has AMX-BF16 or AVX-512F) "
                         "and amx_decode.py (AMX-BF16)")
    ap.add_argument("--peer-eager", action="store_true",
                    help="decode_bench's vLLM without torch.compile (its default compiles the "
                         "model first: many minutes on a 2-core machine)")
    ap.add_argument("--skip-decode", action="store_true",
                    help="skip benchmarks/decode_bench.py (batched decode; vLLM when installed)")
    ap.add_argument("--render-only", type=Path, metavar="JSON",
                    help="rebuild the report of a stored run (e.g. benchmarks/results/latest.json)"
                         ", re-measuring only the machine's limits (best of stored and new)")
    args = ap.parse_args(argv)
    if args.render_only:
        return render_only(args.render_only)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    profile = args.profile if args.profile is not None else mode == "full"
    meta = {**machine_meta(), "mode": mode, "stat": args.stat}
    log(f"tonp benchmarks ({mode}), {meta['threads']} threads, load {meta['load_before']:.1f}")
    machine = roofline.measure_machine(mode)
    log(f"read {machine['read_GBs']:.2f} GB/s, copy {machine['copy_GBs']:.2f} GB/s, "
        f"GEMM {machine['gemm_fp32_GFLOPs']:.1f} GFLOP/s")
    cases, store, runs = mb.make_cases(mode), {}, []
    if args.models:
        cases = [c for c in cases if any(c.name.lower().startswith(m.lower())
                                         for m in args.models)]
        if not cases:
            names = [c.name for c in mb.make_cases(mode)]
            ap.error(f"--models {args.models} matches none of {names}")
    # Batched decode first, in its own process, while this one holds next to nothing: its fp32
    # model, the model's weight groups and vLLM's engine need ~22 of 23 GB on the 2-core machines,
    # and after the model cases below this process keeps ~3 GB resident (freed memory glibc and
    # the pools do not hand back at once): run after them, it was killed for memory.
    decode = None
    if mode != "smoke" and not args.skip_decode:  # vLLM's CPU build as the peer where `make peer-vllm` ran
        log(f"this process holds {resident_gb():.1f} GB before decode_bench")
        decode = run_peer("decode_bench.py", (["--peer"] + (["--peer-eager"] if args.peer_eager else []))
                          if mode == "full" else ["--quick", "--peer", "--peer-eager"],
                          record_stem(RESULTS_DIR, "decode" if mode == "full" else "decode_quick", meta)
                          + ".md", 3600)
    hook = checks_and_profiles(machine, profile, store)
    for case in cases:
        runs.append(mb.bench_case(case, args.stat, dtypes=args.dtypes, on_tonp=hook))
    extra = []
    free_memory()   # what the model cases held, before the benchmarks in processes of their own
    if mode != "smoke":
        if not args.skip_kernels:
            k = run_peer("kernel_bench.py", [] if args.kernels_full else ["--quick"],
                         record_stem(RESULTS_DIR, "kernels" if args.kernels_full else "kernels_quick",
                                     meta) + ".md", 1200)
            extra += [("Kernels (benchmarks/kernel_bench.py)", k[1])] if k else []
        if not args.skip_collectives:
            c = run_peer("collectives.py", ["--quick"], "collectives.md", 900)
            extra += [("Collectives (benchmarks/collectives.py)", c[1])] if c else []
        if not args.skip_serve:
            v = run_peer("serve_bench.py", ["--quick"], "serve_quick.md", 600)
            extra += [("Rollout service (benchmarks/serve_bench.py)", v[1])] if v else []
        if not args.skip_parallel:
            p = run_peer("parallel_bench.py", [] if mode == "full" else ["--quick"],
                         "parallel.md", 1800)
            extra += [("Pipeline and context parallelism (benchmarks/parallel_bench.py)",
                       p[1])] if p else []
        if not args.skip_train:
            t = run_peer("train_bench.py", [] if mode == "full" else ["--quick"],
                         record_stem(RESULTS_DIR, "train" if mode == "full" else "train_quick", meta) + ".md",
                         1800)
            extra += [("Training speed (benchmarks/train_bench.py)", t[1])] if t else []
        if decode:                    # run first (above); reported in its place
            extra += [("Batched decode (benchmarks/decode_bench.py)", decode[1])]
        if not args.skip_amx and (amx.available() or "avx512f" in meta["cpu_flags"]):
            x = run_peer("amx_bench.py", [] if mode == "full" else ["--quick"],
                         record_stem(RESULTS_DIR, "amx" if mode == "full" else "amx_quick", meta) + ".md",
                         1200)
            extra += [("AMX-BF16 (benchmarks/amx_bench.py)", x[1])] if x else []
        if not args.skip_amx and amx.available():
            x = run_peer("amx_decode.py", [] if mode == "full" else ["--quick"],
                         record_stem(RESULTS_DIR, "amx_decode" if mode == "full" else "amx_decode_quick",
                                     meta) + ".md", 1800)
            extra += [("Version 2 in batched decode (benchmarks/amx_decode.py)", x[1])] if x else []
    meta["load_after"] = os.getloadavg()[0]
    machine = roofline.best_of(machine, roofline.measure_machine(mode))
    store["targets"] = all_targets(cases, runs, machine)
    stem = "latest" if mode == "full" else f"latest_{mode}"
    data = {"meta": meta, "machine": machine, "targets": store["targets"],
            "cases": [{"name": c.name, "summary": c.summary(), **r} for c, r in zip(cases, runs)],
            "profiles": store.get("profiles", []), "extra": extra}
    return report(args.out, stem, data, cases)


def resident_gb() -> float:
    """This process's resident memory (Linux; 0 where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) / 2**20
    except (OSError, StopIteration):
        return 0.0


def report(out: Path, stem: str, data: dict, cases) -> dict:
    runs = [{"info": c["info"], "results": c["results"]} for c in data["cases"]]
    md = markdown(data["meta"], data["machine"], cases, runs, data,
                  [tuple(e) for e in data.get("extra", [])])
    paths = write_results(out, stem, md, data)
    if chart(out / f"{stem}.png", cases, runs, data["machine"]):
        paths.append(out / f"{stem}.png")
    print("\n" + md)
    log("wrote " + ", ".join(str(p) for p in paths))
    return data


def render_only(path: Path) -> dict:
    """Rebuild a report from its JSON, re-measuring the machine's limits and keeping the best of
    the stored and the new ones (a bandwidth read during a disturbance understates the bound)."""
    import json
    data = json.loads(path.read_text())
    mode = data["meta"]["mode"]
    by_name = {c.name: c for c in mb.make_cases(mode)}
    cases = [by_name[c["name"]] for c in data["cases"]]
    new = roofline.measure_machine(mode)
    old = data["machine"]
    data["machine"] = roofline.best_of(*old.pop("measurements", [old]), new)
    for k in ("gemm_n", "bandwidth_bytes"):
        data["machine"][k] = old[k]
    data["meta"]["rendered"] = True
    if "extra" not in data:  # reports written before the peers' tables were stored in the JSON
        data["extra"] = [(title, (RESULTS_DIR / name).read_text()) for title, name in PEERS
                         if (RESULTS_DIR / name).exists()]
    runs = [{"info": c["info"], "results": c["results"]} for c in data["cases"]]
    data["targets"] = all_targets(cases, runs, data["machine"])
    return report(path.parent, path.stem, data, cases)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
