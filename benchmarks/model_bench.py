"""Rollout and training throughput of tonp ("invariant" and "torch" kernel modes) against Hugging
Face transformers' Qwen3MoeForCausalLM, with the same weights and dtype, in one process.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/run_all.py [--quick]   # what `make bench` runs

What one engine is timed on (the same for the three):
  * decode: greedy generation of equal-length random prompts at batch 1 and 16, KV cache on
    (tonp: `tonp_models.generate` with its paged cache; transformers: `generate(do_sample=False)`,
    DynamicCache). A decode step is one forward over one new token per sequence plus the token
    pick; its time is the gap between consecutive steps (tonp: forward starts, seen through a thin
    proxy; transformers: calls of a LogitsProcessor, which runs once per step). The median step
    over every decode step of `repeat` calls is reported; tokens/s = batch / step.
  * engines alive together are measured round-robin (each repeat runs every engine once), so a
    burst of load on a shared machine hits them alike: tonp's two modes always (one model), and
    transformers with them when the model is small.
  * prefill: one generate call with max_new_tokens=1 (the whole prompt batch in one forward, the
    LM head on the last rows only, one token pick); tokens/s = prompt tokens / call.
  * training: forward + backward of the mean token log-prob of a [B, L] batch (tonp:
    `model.token_logprobs`; transformers: `log_softmax(logits.float())` gathered at the targets).
Weights: a model built once from torch.manual_seed(0) is written with `save_pretrained`; tonp and
transformers both load it in the dtype under test. At most one model is alive at a time (the
30B-A3B-shaped one is 5 GB in fp32, and training adds as much again in gradients).
"""
from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

import tonp_kernels as tk
from tonp_models import Qwen3MoeConfig, Qwen3MoeForCausalLM, generate
from tonp_models.engine import PageAllocator, extend

import roofline
from benchlib import ForwardClock, free_memory, log, summarize, timeit_interleaved

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TONP_MODES = ("invariant", "torch")
HF_ATTN = "sdpa"  # transformers' default and fastest CPU attention; its experts use grouped_mm


@dataclass
class Case:
    """One model and the sizes it is measured at.

    decode: {batch: new tokens per call} (new tokens - 1 decode steps per call); prompt_len:
    decode prompt length; prefill/train: (sequences, tokens each)."""
    name: str
    config: Qwen3MoeConfig
    prompt_len: int
    decode: Dict[int, int]
    prefill: tuple
    train: tuple
    repeat: int
    max_total_s: float
    max_call_s: float
    profile_steps: int = 3
    bandwidth_target: bool = False  # batch-1 decode must reach 60% of the memory bound

    def summary(self) -> str:
        c = self.config
        return (f"{c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_attention_heads}/"
                f"{c.num_key_value_heads} heads x {c.head_dim}, {c.num_experts} experts top-"
                f"{c.num_experts_per_tok} (moe_intermediate {c.moe_intermediate_size}), vocab "
                f"{c.vocab_size}")


def make_cases(mode: str) -> List[Case]:
    """mode: "full" (tiny + 30B-A3B-shaped), "quick" (tiny, fewer steps), "smoke" (1-layer tiny,
    one repeat: checks that the code runs)."""
    if mode == "smoke":
        cfg = Qwen3MoeConfig.preset("tiny", num_hidden_layers=1)
        return [Case("tiny-1L", cfg, 8, {1: 3, 16: 3}, (1, 16), (1, 16), 1, 1.0, 5.0, 2)]
    tiny = Qwen3MoeConfig.preset("tiny")
    if mode == "quick":
        return [Case("tiny", tiny, 32, {1: 9, 16: 9}, (1, 128), (1, 128), 2, 3.0, 10.0)]
    big = Qwen3MoeConfig.preset("qwen3_30b_a3b", num_hidden_layers=2, vocab_size=16384,
                                max_position_embeddings=4096, bos_token_id=None,
                                eos_token_id=None)  # the hub's ids lie outside the small vocab
    return [Case("tiny", tiny, 32, {1: 33, 16: 33}, (4, 256), (4, 256), 5, 8.0, 20.0),
            Case("30B-A3B shapes, 2 layers", big, 32, {1: 9, 16: 5}, (1, 256), (1, 128), 2, 25.0,
                 30.0, 2, bandwidth_target=True)]


# ---------------------------------------------------------------------------------------------
# Engines: the same three calls (decode steps, prefill, training step) for tonp and transformers
# ---------------------------------------------------------------------------------------------
class TonpEngine:
    def __init__(self, model: Qwen3MoeForCausalLM, mode: str):
        self.model = self.module = model
        self.mode, self.name = mode, f"tonp {mode}"

    def decode_steps(self, prompts: torch.Tensor, n_new: int) -> List[float]:
        """Seconds of each decode step (all but the prefill forward) of one greedy generate."""
        clock = ForwardClock(self.model)
        with tk.use(self.mode):
            out = generate(clock, list(prompts), n_new, max_batch_size=len(prompts))
        end = time.perf_counter()
        assert all(len(c) == n_new for c in out.completions), "generation stopped early"
        starts = [s for s, _ in clock.spans[1:]] + [end]
        return [b - a for a, b in zip(starts[:-1], starts[1:])]

    def prefill(self, prompts: torch.Tensor) -> None:
        with tk.use(self.mode):
            generate(self.model, list(prompts), 1, max_batch_size=len(prompts))

    def train_step(self, ids: torch.Tensor) -> None:
        """zero_grad, forward, backward, and the step's own gradients freed at its end (as the
        next step's zero_grad would): so no engine is timed freeing another engine's gradients
        (freeing stock torch's 2.4 GB of 30B-layer gradients took ~220 ms of the next step)."""
        self.model.zero_grad(set_to_none=True)
        with tk.use(self.mode):
            lps = self.model.token_logprobs(list(ids))
            (-torch.cat(lps).mean()).backward()
        self.model.zero_grad(set_to_none=True)


class _StepClock:
    """A transformers LogitsProcessor that notes the time of each call (once per step)."""

    def __init__(self):
        self.times: List[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


class HFEngine:
    def __init__(self, hf):
        self.hf = self.module = hf
        self.name = "transformers"
        hf.generation_config.eos_token_id = None  # random weights: never stop early
        hf.generation_config.pad_token_id = 0

    def _generate(self, prompts: torch.Tensor, n_new: int, processors=()):
        from transformers import LogitsProcessorList
        return self.hf.generate(prompts, attention_mask=torch.ones_like(prompts),
                                max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                                use_cache=True, logits_processor=LogitsProcessorList(processors))

    def decode_steps(self, prompts: torch.Tensor, n_new: int) -> List[float]:
        clock = _StepClock()
        out = self._generate(prompts, n_new, [clock])
        assert out.shape[1] == prompts.shape[1] + n_new, "generation stopped early"
        return [b - a for a, b in zip(clock.times[:-1], clock.times[1:])]

    def prefill(self, prompts: torch.Tensor) -> None:
        self._generate(prompts, 1)

    def train_step(self, ids: torch.Tensor) -> None:
        self.hf.zero_grad(set_to_none=True)
        logits = self.hf(ids).logits                                                # (B, L, V)
        lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])
        (-lp.mean()).backward()
        self.hf.zero_grad(set_to_none=True)  # its own gradients freed in its own step (TonpEngine)


def load_hf(path: Path, dtype: torch.dtype):
    import transformers
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(path, dtype=dtype,
                                                          attn_implementation=HF_ATTN)
    return hf.eval()


# ---------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------
def _tokens(case: Case, shape: tuple, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, case.config.vocab_size, shape, generator=g)


def bench_engines(engines: list, case: Case, stat: str) -> Dict[str, dict]:
    """Every measurement (decode_b{batch}, prefill, train -> {tok_s, ...}) of several engines,
    round-robin (each repeat runs every engine once), so load drift hits them alike."""
    out: Dict[str, dict] = {e.name: {} for e in engines}
    for batch, n_new in case.decode.items():
        prompts = _tokens(case, (batch, case.prompt_len), seed=batch)
        for e in engines:
            e.decode_steps(prompts, min(3, n_new))                     # warm-up
        steps: Dict[str, List[float]] = {e.name: [] for e in engines}
        probes = [roofline.read_bandwidth_now()]      # the bus as these steps see it
        for _ in range(case.repeat):
            for e in engines:
                steps[e.name] += e.decode_steps(prompts, n_new)
            probes.append(roofline.read_bandwidth_now())
        for e in engines:
            step_s = summarize(steps[e.name], stat)
            out[e.name][f"decode_b{batch}"] = {
                "tok_s": batch / step_s, "step_s": step_s, "steps": len(steps[e.name]),
                "batch": batch, "context": case.prompt_len + n_new / 2,
                "read_GBs": statistics.median(probes), "read_GBs_probes": probes}
            log(f"    {e.name} decode b{batch}: {batch / step_s:.1f} tok/s")
    for what in ("prefill", "train"):
        B, L = getattr(case, what)
        ids = _tokens(case, (B, L), seed=100)
        fns = {e.name: (lambda e=e: getattr(e, "prefill" if what == "prefill" else
                                            "train_step")(ids)) for e in engines}
        times = timeit_interleaved(fns, repeat=case.repeat, max_total_s=case.max_total_s,
                                   max_call_s=case.max_call_s, stat=stat)
        for name, t in times.items():
            out[name][what] = {"tok_s": B * L / t.seconds, "step_s": t.seconds,
                               "runs": t.runs, "note": t.note, "tokens": B * L}
            log(f"    {name} {what}: {B * L / t.seconds:.1f} tok/s ({t.runs} runs)")
    for e in engines:
        e.module.zero_grad(set_to_none=True)
    return out


# Below this size (fp32 bytes) transformers and tonp are loaded together and measured
# round-robin; above it, one model at a time (the 30B-A3B-shaped one is 5 GB, training doubles it).
SHARE_MEMORY_BYTES = 2 ** 30


def bench_case(case: Case, stat: str = "median", dtypes=("fp32", "bf16"),
               on_tonp: Optional[Callable] = None) -> dict:
    """Measure every engine of a case in both dtypes. `on_tonp(case, dtype, model, results)` is
    called while the tonp model is alive (after both its modes and transformers are measured):
    the place for checks and profiles that need the model. Returns {dtype: {engine: {...}}}.
    tonp's two modes are always measured round-robin; transformers joins them when the model is
    small (SHARE_MEMORY_BYTES), else it runs first, alone."""
    results: dict = {}
    info: dict = {}
    with tempfile.TemporaryDirectory(prefix="tonp_bench_") as tmp:
        path = Path(tmp) / "ckpt"
        torch.manual_seed(0)
        log(f"{case.name}: building random weights and saving them")
        model = Qwen3MoeForCausalLM(case.config, dtype=torch.float32)
        info["params"] = sum(p.numel() for p in model.parameters())
        together = info["params"] * 4 <= SHARE_MEMORY_BYTES
        info["round_robin"] = "all three engines" if together else "tonp modes only"
        model.save_pretrained(path)
        del model
        free_memory()
        for name in dtypes:
            dtype = DTYPES[name]
            res = results[name] = {}
            log(f"{case.name} {name}: transformers (attn {HF_ATTN})"
                + (", with tonp" if together else ""))
            hf = load_hf(path, dtype)
            info["hf_attention"] = hf.config._attn_implementation
            info["hf_experts"] = getattr(hf.config, "_experts_implementation", "n/a")
            engines = [HFEngine(hf)]
            if not together:
                res.update(bench_engines(engines, case, stat))
                del hf, engines
                free_memory()
                engines = []
            model = Qwen3MoeForCausalLM.from_pretrained(path, dtype=dtype)
            engines += [TonpEngine(model, mode) for mode in TONP_MODES]
            log(f"{case.name} {name}: " + ", ".join(e.name for e in engines))
            res.update(bench_engines(engines, case, stat))
            if on_tonp is not None:
                on_tonp(case, name, model, res)
            del model, engines
            hf = None
            free_memory()
    return {"info": info, "results": results}


# ---------------------------------------------------------------------------------------------
# Profiles of the largest costs (torch.profiler; op name, input shapes, ms per step)
# ---------------------------------------------------------------------------------------------
def profile_decode(model, case: Case, batch: int, mode: str = "invariant", top: int = 12) -> dict:
    """Top ops by self CPU time over `case.profile_steps` decode steps at `batch` (the step of
    `generate`: one cached forward, last-row logits, argmax), prefill excluded."""
    steps = case.profile_steps
    prompts = _tokens(case, (batch, case.prompt_len), seed=batch)
    with torch.no_grad(), tk.use(mode):
        pages = PageAllocator(model.new_cache(batch, case.prompt_len + steps + 1))
        slots = [pages.add_sequence() for _ in range(batch)]
        cu = torch.arange(batch + 1, dtype=torch.int32) * case.prompt_len
        logits = extend(model, pages, prompts.reshape(-1), slots, cu,
                        logits_rows=(cu[1:] - 1).long())
        state = {"ids": tk.argmax(logits)}
        cu1 = torch.arange(batch + 1, dtype=torch.int32)
        rows = torch.arange(batch)

        def decode():
            for _ in range(steps):
                logits = extend(model, pages, state["ids"], slots, cu1, logits_rows=rows)
                state["ids"] = tk.argmax(logits)
        return _profile(decode, steps, top)


def profile_train(model, case: Case, mode: str = "invariant", top: int = 12) -> dict:
    """Top ops by self CPU time of one training step (forward + backward)."""
    B, L = case.train
    ids = _tokens(case, (B, L), seed=100)
    engine = TonpEngine(model, mode)
    out = _profile(lambda: engine.train_step(ids), 1, top)
    model.zero_grad(set_to_none=True)
    return out


def _profile(fn, steps: int, top: int) -> dict:
    """Self CPU time per op name (summed over shapes; the costliest shape shown), per step."""
    from torch.profiler import ProfilerActivity, profile
    # No warm-up: profiles run after the measurements, so every path is already warm.
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
    ops: Dict[str, dict] = {}
    for e in prof.key_averages(group_by_input_shape=True):
        o = ops.setdefault(e.key, {"op": e.key, "us": 0.0, "calls": 0, "top_us": -1.0})
        o["us"] += e.self_cpu_time_total
        o["calls"] += e.count
        if e.self_cpu_time_total > o["top_us"]:
            o["top_us"], o["shapes"] = e.self_cpu_time_total, _shapes(e.input_shapes)
    total = sum(o["us"] for o in ops.values()) or 1.0
    best = sorted(ops.values(), key=lambda o: o["us"], reverse=True)[:top]
    rows = [{"op": o["op"], "shapes": o["shapes"], "calls_per_step": o["calls"] / steps,
             "ms_per_step": o["us"] / 1e3 / steps, "share": o["us"] / total,
             "top_shape_share": o["top_us"] / max(o["us"], 1e-9)} for o in best]
    return {"wall_ms_per_step": wall * 1e3 / steps, "self_ms_per_step": total / 1e3 / steps,
            "top": rows}


def _shapes(shapes) -> str:
    s = ", ".join(str(list(x)) for x in (shapes or []) if x)
    return s if len(s) <= 80 else s[:77] + "..."
