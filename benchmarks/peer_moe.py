"""The fp32 MoE experts' stage of one decode step: tonp's `moe_experts` + `moe_combine` against
vLLM's CPU kernel `cpu_fused_moe` (its "vec" path, the weights packed once by its
`prepack_moe_weight`), in one process on the same weights, tokens and routing, alternated, the
read bandwidth probed around each round.

vLLM's kernels are loaded from its own venv (`make peer-vllm`: `.venv-vllm`, which pins the same
torch 2.13.0+cpu) with `torch.ops.load_library`; nothing of vLLM is imported into this venv.
Without that venv the benchmark says "not installed" and writes nothing.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/peer_moe.py                 # ~2 min
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/peer_moe.py --tokens 16,64,128 --rounds 5

Routing: uniform (each token's top 8 of 128 experts drawn at random) or `--routing model`: the
30B-A3B-shaped bench model's own routing (decode_bench.py's model and prompts, layer 0 at a
decode step). 30B-A3B expert shapes: 128 experts, hidden 2048, intermediate 768. Writes
benchmarks/results/peer_moe.{md,json}; not part of `make bench`.

`--rows 1,2,4` measures instead with every expert given exactly that many rows (16 R tokens,
token t routed to experts 8t .. 8t + 7 mod 128): where in the rows an expert the two kernels
part. Writes benchmarks/results/peer_moe_rows.{md,json}.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import roofline  # noqa: E402
from benchlib import RESULTS_DIR, log, machine_meta, md_table, write_record  # noqa: E402

import tonp_kernels as tk  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VLLM_PKG = REPO / ".venv-vllm" / "lib" / "python3.11" / "site-packages" / "vllm"
E, H, I, TOP = 128, 2048, 768, 8


def vllm_library() -> Path:
    """The kernel library vLLM itself loads on this CPU (vllm/platforms/cpu.py `import_kernels`):
    on x86 _C with AVX512-BF16, _C_AVX512 with AVX-512 alone, _C_AVX2 otherwise (_C on an
    AVX2-only CPU dies of an illegal instruction); _C elsewhere."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return VLLM_PKG / "_C.abi3.so"
    if torch.cpu._is_avx512_supported():
        return VLLM_PKG / ("_C.abi3.so" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512.abi3.so")
    return VLLM_PKG / "_C_AVX2.abi3.so"


def model_routing(tokens: int) -> torch.Tensor:
    """Layer 0's expert ids at the first decode step of decode_bench's model and prompts."""
    import decode_bench as db
    from tonp_models import Qwen3MoeForCausalLM, generate
    from tonp_models.layers.probe import pop_hook, push_hook
    cfg = db.make_config(db.parse_args([]))
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size, (tokens, 64), generator=g).tolist()
    got = []

    def hook(op, value, **meta):
        if op == "route.ids" and value.shape[0] == tokens:
            got.append(value.clone())
    push_hook(hook)
    try:
        generate(model, prompts, 2, max_batch_size=tokens)
    finally:
        pop_hook(hook)
    return got[0]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="16,64,128")
    ap.add_argument("--routing", choices=("uniform", "model"), default="uniform")
    ap.add_argument("--rows", default="", help="rows every expert gets, comma separated (instead of --tokens)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    a = ap.parse_args(argv)
    try:
        per_expert = [int(r) for r in a.rows.split(",")] if a.rows else []
    except ValueError:
        ap.error(f"--rows {a.rows!r}: comma-separated whole numbers of rows an expert")
    if any(r < 1 for r in per_expert):
        ap.error(f"--rows {a.rows!r}: every expert needs at least one row")
    lib = vllm_library()
    if not lib.exists():
        log("peer_moe: vLLM not installed (make peer-vllm); nothing measured")
        return {}
    torch.ops.load_library(str(lib))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    torch.manual_seed(0)
    gu = tk.on_huge_pages(torch.randn(E, 2 * I, H) * 0.02)
    dn = tk.on_huge_pages(torch.randn(E, H, I) * 0.02)
    gug, dng = tk.pack_weight_groups(gu), tk.pack_weight_groups(dn)
    vgu, vdn = torch.empty_like(gu), torch.empty_like(dn)
    torch.ops._C.prepack_moe_weight(gu, vgu, "vec")
    torch.ops._C.prepack_moe_weight(dn, vdn, "vec")
    meta = machine_meta()
    rows, results = [], []
    for tokens in ([E * r // TOP for r in per_expert] or [int(t) for t in a.tokens.split(",")]):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(tokens, H, generator=g)
        if per_expert:  # every expert tokens * TOP / E rows
            ids = (torch.arange(tokens * TOP) % E).view(tokens, TOP)
        elif a.routing == "model":
            ids = model_routing(tokens)
        else:
            ids = torch.stack([torch.randperm(E, generator=g)[:TOP] for _ in range(tokens)])
        w = torch.softmax(torch.randn(tokens, TOP, generator=g), -1)
        ids32, out = ids.to(torch.int32), torch.empty(tokens, H)
        experts = int(ids.unique().numel())
        gb = experts * 3 * H * I * 4 / 1e9

        def tonp():
            t = time.perf_counter()
            y = tk.moe_combine(w, tk.moe_experts(x, ids, gu, dn, gate_up_groups=gug, down_groups=dng))
            return time.perf_counter() - t, y

        def vllm():
            t = time.perf_counter()
            torch.ops._C.cpu_fused_moe(out, x, vgu, vdn, None, None, w, ids32, False, "silu", "vec")
            return time.perf_counter() - t, out
        # Both compute in fp32 (different orders): a check that they ran the same experts.
        diff = (tonp()[1] - vllm()[1]).abs().max().item()
        ratios, ts, vs, probes = [], [], [], []
        for _ in range(a.rounds):
            p0 = roofline.read_bandwidth_now(256)
            t = min(tonp()[0] for _ in range(2))
            v = min(vllm()[0] for _ in range(2))
            probes.append((p0, roofline.read_bandwidth_now(256)))
            ts.append(t), vs.append(v), ratios.append(v / t)
        r = {**({"rows_per_expert": tokens * TOP // E} if per_expert else {}), "tokens": tokens, "experts": experts, "tonp_ms": [t * 1e3 for t in ts],
             "vllm_ms": [v * 1e3 for v in vs], "probes_GBs": probes,
             "tonp_speed_over_vllm": statistics.median(ratios), "max_abs_diff": diff}
        results.append(r)
        log(f"peer_moe: {tokens} tokens: tonp / vLLM speed {r['tonp_speed_over_vllm']:.3f}")
        rows.append([*([tokens * TOP // E] if per_expert else []), tokens, experts,
                     f"{min(ts) * 1e3:.1f} ({gb / min(ts):.1f} GB/s)",
                     f"{min(vs) * 1e3:.1f} ({gb / min(vs):.1f} GB/s)",
                     f"{min(p for pr in probes for p in pr):.0f}-{max(p for pr in probes for p in pr):.0f}",
                     f"{r['tonp_speed_over_vllm']:.2f}x", f"{diff:.1e}"])
    md = (f"# The fp32 experts' stage: tonp against vLLM's cpu_fused_moe\n\n{meta['date']}; "
          f"{meta['cpu']}; kernel table **{tk.isa()}**; {torch.get_num_threads()} threads; "
          f"{E} experts, hidden {H}, intermediate {I}, top {TOP}; routing: "
          f"{'every expert the same rows' if per_expert else a.routing}; "
          f"{a.rounds} rounds, best of 2 each.\n\n"
          + md_table([*(["rows / expert"] if per_expert else []), "tokens", "experts", "tonp ms (GB/s)",
                      "vLLM ms (GB/s)", "probes GB/s",
                      "tonp / vLLM speed (median of rounds)", "largest abs difference"], rows)
          + "\n\ntonp: `moe_experts` (weight groups) + `moe_combine`; vLLM: `cpu_fused_moe` "
            "(isa vec, weights prepacked), loaded from .venv-vllm into this process. GB/s: the "
            "distinct experts' weight bytes over the best time. The outputs differ in the "
            "last bits (two fp32 orders): a check that both ran the same experts.\n")
    data = {"meta": meta, "routing": "rows per expert" if per_expert else a.routing, "results": results}
    write_record(a.out, "peer_moe_rows" if per_expert else "peer_moe", md, data)
    return data


if __name__ == "__main__":
    main()
