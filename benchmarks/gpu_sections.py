"""The sections of benchmarks/gpu_check.py that check bits: the exact kernels against the CPU's,
the fast kernels' invariances, and the model end to end in both numerics. Each takes a
gpu_check.Section `sec` (device, dry run, time left) and records checks on it; sizes are tiny
in a dry run."""
from __future__ import annotations

import contextlib
import copy
import time

import torch

import tonp_kernels as tk
from benchlib import same_bits
from tonp_kernels.accel import (attention, fast_attention as fa, fast_linear as fl,
                                fast_moe, linear, moe, rowwise, sample, vocab)

F32, BF16 = torch.float32, torch.bfloat16


class Inputs:
    """Seeded random CPU tensors."""

    def __init__(self, seed: int = 0):
        self.g = torch.Generator().manual_seed(seed)

    def __call__(self, *shape, dtype=F32, scale=1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.g) * scale).to(dtype)

    def ints(self, high, *shape) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=self.g)


def _to(dev, xs):
    return [x.to(dev) if isinstance(x, torch.Tensor) else x for x in xs]


def _tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _compare(sec, what, device_fn, cpu_fn, *inputs) -> bool:
    t0 = time.time()
    got = _tuple(device_fn(*_to(sec.device, inputs)))
    t1 = time.time()
    ref = _tuple(cpu_fn(*inputs))
    if not sec.dry and time.time() - t0 > 3:  # where a section's time goes (first calls compile)
        sec.note(f"{what}: device {t1 - t0:.1f} s (compile included), CPU {time.time() - t1:.1f} s")
    return sec.check(what, len(got) == len(ref) and all(same_bits(a, b) for a, b in zip(got, ref)))


def _paged(k, v, cu, B):
    """The packed K/V of each sequence in consecutive pages of B rows (zeros elsewhere)."""
    lens = (cu[1:] - cu[:-1]).tolist()
    need = [-(-n // B) for n in lens]
    kc = torch.zeros((sum(need), B) + tuple(k.shape[1:]), dtype=k.dtype)
    vc = torch.zeros_like(kc)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    first = 0
    for s, n in enumerate(lens):
        table[s, :need[s]] = torch.arange(first, first + need[s], dtype=torch.int32)
        first += need[s]
        rows = torch.arange(n)
        kc[table[s, rows // B].long(), rows % B] = k[int(cu[s]):int(cu[s]) + n]
        vc[table[s, rows // B].long(), rows % B] = v[int(cu[s]):int(cu[s]) + n]
    return kc, vc, table


def _tracked_lp(logits, targets, temperature, chunks):
    """tk.token_logprobs as training calls it: logits that require a gradient."""
    x = logits.clone().requires_grad_()
    return tk.token_logprobs(x, targets, temperature=temperature, chunks=chunks).detach()


# ---------------------------------------------------------------------------------------------
# exact: every op's Triton kernel on the device against the C++ op on the CPU
# ---------------------------------------------------------------------------------------------
def exact_ops(sec) -> None:
    ops, r = torch.ops.tonp, Inputs(0)
    big = not sec.dry
    M, K, N = (21, 2048, 512) if big else (5, 40, 33)
    T, Hq, Hkv, D, B = (300, 8, 2, 128, 64) if big else (9, 4, 2, 16, 4)
    E, I, V = (16, 256, 4096) if big else (4, 8, 64)
    for dt in (F32, BF16):
        x, w, b = r(M, K, dtype=dt), r(N, K, dtype=dt, scale=K ** -0.5), r(N)
        _compare(sec, f"linear {dt} + bias, C=8", linear.linear, ops.linear, x, w, b, 8, None)
        _compare(sec, f"linear {dt} -> fp32, C=4 (a TP partial)", linear.linear, ops.linear, x, w,
                 None, 4, F32)
        _compare(sec, f"rms_norm {dt}", rowwise.rms_norm, ops.rms_norm, x, r(K), 1e-6)
        _compare(sec, f"silu_mul {dt}", rowwise.silu_mul, ops.silu_mul, x, r(M, K, dtype=dt))
        _compare(sec, f"rope {dt}", rowwise.rope, ops.rope, r(M, 4, 16, dtype=dt), r(64, 16),
                 r(64, 16), r.ints(64, M))
        _compare(sec, f"moe_combine {dt}", rowwise.moe_combine, ops.moe_combine,
                 torch.rand(M, 2, generator=r.g), r(M, 2, 16, dtype=dt))
        _compare(sec, f"moe_route {dt}", moe.moe_route, ops.moe_route, r(M, E, dtype=dt, scale=2),
                 2, True)
        H = 256 if big else 32
        _compare(sec, f"moe_experts {dt}", moe.moe_experts, ops.moe_experts, r(M, H, dtype=dt),
                 r.ints(E, M, 2), r(E, 2 * I, H, dtype=dt, scale=H ** -0.5),
                 r(E, H, I, dtype=dt, scale=I ** -0.5), 0, 2)
        lens = torch.tensor([1, T // 3, T - 1 - T // 3])
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
        q, k, v = r(T, Hq, D, dtype=dt), r(T, Hkv, D, dtype=dt), r(T, Hkv, D, dtype=dt)
        _compare(sec, f"attention_varlen {dt}", attention.attention_varlen, ops.attention_varlen,
                 q, k, v, cu, D ** -0.5, B)
        kc, vc, table = _paged(k, v, cu, B)
        seq, pos = torch.tensor([0, 1, 2, 2]), torch.tensor([0, int(lens[1]) - 1, 0, 5])
        _compare(sec, f"attention_paged {dt}", attention.attention_paged, ops.attention_paged,
                 q[:4], kc, vc, table, seq, pos, D ** -0.5)
        logits, targets = r(M, V, dtype=dt, scale=3), r.ints(V, M)
        _compare(sec, f"lse_partial {dt}", vocab.lse_partial, ops.lse_partial, logits, 0.7, 8)
        _compare(sec, f"max_with_index {dt}", vocab.max_with_index, ops.max_with_index, logits)
        _compare(sec, f"token_logprobs {dt}", vocab.token_logprobs, ops.token_logprobs, logits,
                 targets, 0.7, 8)
    for dt in (F32, BF16):  # training's token_logprobs: lse + gather + x / T under autograd
        _compare(sec, f"token_logprobs {dt} under autograd (lse, gather, / T)", _tracked_lp,
                 _tracked_lp, r(M, V, dtype=dt, scale=3), r.ints(V, M), 0.7, 8)
        _compare(sec, f"sample {dt} (seeded, top-k, top-p)", sample.sample, ops.sample,
                 r(M, V, dtype=dt, scale=3), 0.8, 20, 0.9, 7, torch.arange(M), torch.arange(M))


# ---------------------------------------------------------------------------------------------
# the model through the dispatch: tk.use("invariant", numerics=...)
# ---------------------------------------------------------------------------------------------
def numerics(sec, kind: str):
    """tk.use("invariant", numerics=kind): the device's tensors run the Triton kernels (a dry
    run's CPU tensors too, through the interpreter: backend="triton"; the CPU references are
    computed outside this context, by the C++ kernels)."""
    return tk.use("invariant", numerics=kind, backend="triton" if sec.dry else "auto")


def tiny_model(dtype=F32, **overrides):
    from tonp_models import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig.preset("tiny", initializer_range=0.08, max_position_embeddings=256,
                                **overrides)
    return Qwen3MoeForCausalLM(cfg, dtype=dtype)


def _model(sec, dtype=F32):
    """The tiny model; one layer in a dry run (the interpreter runs every kernel in Python, and
    the dry run shows the section runs, not that three layers agree)."""
    return tiny_model(dtype, **({"num_hidden_layers": 1} if sec.dry else {}))


def _prompts(n: int, vocab_size: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (int(L),), generator=g)
            for L in torch.randint(3, 40, (n,), generator=g)]


def _rollouts(model, prompts, new, **kw):
    from tonp_models import generate
    out = generate(model, prompts, new, **kw)
    return [s.cpu() for s in out.sequences], [lp.cpu() for lp in out.logprobs]


def exact_model(sec) -> None:
    """The tiny model on the device in exact numerics: the CPU's bits for the training forward
    (token_logprobs), greedy decode and a seeded, top-k / top-p sampled generate."""
    cpu = _model(sec)
    prompts = _prompts(2 if sec.dry else 6, cpu.config.vocab_size)
    new = 3 if sec.dry else 16
    ref_lp = cpu.token_logprobs(prompts)
    ref_greedy = _rollouts(cpu, prompts, new)
    ref_sampled = _rollouts(cpu, prompts, new, temperature=0.8, top_k=40, top_p=0.9, seed=3)
    ref_lp_t = cpu.token_logprobs(prompts, temperature=0.8)
    dev = copy.deepcopy(cpu).to(sec.device)
    with numerics(sec, "exact"):
        lp = dev.token_logprobs([p.to(sec.device) for p in prompts])
        lp_t = dev.token_logprobs([p.to(sec.device) for p in prompts], temperature=0.8)
        greedy = _rollouts(dev, prompts, new)
        sampled = _rollouts(dev, prompts, new, temperature=0.8, top_k=40, top_p=0.9, seed=3)
        train = dev.token_logprobs([q.to(sec.device) for q in sampled[0]], temperature=0.8)
    sec.check("token_logprobs (training forward)",
              all(same_bits(a, b) for a, b in zip(lp, ref_lp)))
    sec.check("token_logprobs at T = 0.8 (training forward)",
              all(same_bits(a, b) for a, b in zip(lp_t, ref_lp_t)))
    sec.check("on the device: training logprobs of the sampled rollouts (T = 0.8) == the "
              "rollout's", all(same_bits(t[len(p) - 1:].detach(), lp_r) for t, p, lp_r
                               in zip(train, prompts, sampled[1])))
    for what, got, ref in (("greedy", greedy, ref_greedy), ("sampled", sampled, ref_sampled)):
        sec.check(f"{what} generate: tokens", all(map(torch.equal, got[0], ref[0])))
        sec.check(f"{what} generate: logprobs", all(map(same_bits, got[1], ref[1])))


# The op families whose fast kernels fast_model switches on one at a time when the whole model
# differs (the others then run their exact kernels): which family breaks train == rollout.
FAST_FAMILIES = (("linear",), ("attention_varlen", "attention_paged"), ("moe_experts",))


@contextlib.contextmanager
def fast_only(ops):
    """Inside: the fast kernels of `ops` alone; every other op runs its exact kernel."""
    from tonp_kernels.accel import registry
    saved, cached = dict(registry.FAST), dict(registry._fast)
    registry.FAST.clear()
    registry.FAST.update({o: saved[o] for o in ops})
    registry._fast.clear()
    try:
        yield
    finally:
        registry.FAST.clear()
        registry.FAST.update(saved)
        registry._fast.clear()
        registry._fast.update(cached)


def _train_vs_rollout(sec, model, prompts, new):
    """(rollouts, rollout logprobs, whether the training forward's logprobs equal them, a
    detail: differing tokens, the first (sequence, index), the largest |difference|)."""
    with numerics(sec, "fast"):
        seqs, lps = _rollouts(model, prompts, new, temperature=0.9, seed=5)
        train = model.token_logprobs([s.to(sec.device) for s in seqs], temperature=0.9)
    bad, first, worst = 0, None, 0.0
    for i, (t, p, lp) in enumerate(zip(train, prompts, lps)):
        t = t[len(p) - 1:].detach().cpu()
        diff = (t.view(-1) != lp.view(-1)).nonzero().view(-1)
        if diff.numel():
            bad += diff.numel()
            first = first or (i, int(diff[0]))
            worst = max(worst, float((t.double() - lp.double()).abs().max()))
    detail = "" if not bad else (f"({bad} of {sum(map(len, lps))} tokens differ; first: sequence "
                                 f"{first[0]} token {first[1]}; max |diff| {worst:.3g})")
    return seqs, lps, not bad, detail


def fast_model(sec) -> None:
    """The tiny model (fp32 and bf16) in fast numerics on the device: the training forward's
    logprobs of the rollouts equal the rollout's own (decode) logprobs, and a prompt's rollout
    alone equals it in a batch. Where they differ, each op family's fast kernels run alone."""
    for dtype in (F32, BF16):
        model = _model(sec, dtype).to(sec.device)
        prompts = _prompts(2 if sec.dry else 8, model.config.vocab_size, seed=2)
        new = 3 if sec.dry else 24
        seqs, lps, ok, detail = _train_vs_rollout(sec, model, prompts, new)
        sec.check(f"{dtype}: training logprobs == rollout logprobs", ok, detail)
        with numerics(sec, "fast"):
            graph = model.token_logprobs([q.to(sec.device) for q in seqs], temperature=0.9)
            with torch.no_grad():
                plain = model.token_logprobs([q.to(sec.device) for q in seqs], temperature=0.9)
        sec.check(f"{dtype}: the training forward under autograd == under no_grad",
                  all(same_bits(a.detach(), b) for a, b in zip(graph, plain)))
        with numerics(sec, "fast"):
            alone = _rollouts(model, prompts[1:2], new, temperature=0.9, seed=5,
                              request_ids=[1])
        sec.check(f"{dtype}: a prompt alone == in a batch of {len(prompts)}",
                  torch.equal(alone[0][0], seqs[1]) and same_bits(alone[1][0], lps[1]))
        # a dry run shows the subsets run (one, once: the interpreter is slow)
        families = FAST_FAMILIES if not ok else FAST_FAMILIES[:1] if sec.dry and dtype == F32 \
            else ()
        for ops in families:
            with fast_only(ops):
                _, _, ok_ops, detail = _train_vs_rollout(sec, model, prompts, new)
            sec.check(f"{dtype}, fast {' + '.join(ops)} alone (exact others): training "
                      "logprobs == rollout logprobs", ok_ops, detail)


# ---------------------------------------------------------------------------------------------
# fast: the invariances on the device, kernel by kernel
# ---------------------------------------------------------------------------------------------
# The shapes of the invariance checks: (linear K, N, C, rows), (attention Hq, Hkv, D, B, lens),
# (moe M, H, I, E, top). BIG: the 30B model's; TINY: the tiny model's (fast_model runs it), with
# more tokens than a 64-row tile per expert; DRY: a dry run's, interpreted.
BIG = ((2048, 2048, 8, 4096), (32, 4, 128, 64, (1, 100, 300)), (256, 2048, 768, 16, 8))
TINY = ((64, 64, 8, 300), (4, 2, 16, 16, (1, 100, 300)), (300, 64, 32, 8, 2))
DRY = ((128, 160, 8, 66), (4, 2, 16, 16, (1, 5, 21)), (12, 64, 32, 4, 2))


def fast_kernels(sec) -> None:
    _fast_kernels(sec, BIG if not sec.dry else DRY, "")


def fast_kernels_tiny(sec) -> None:
    """The same invariances at the tiny model's shapes (chunks of 8 and 4 elements, head_dim 16,
    a page of 16): where fast_model's end-to-end check rests."""
    _fast_kernels(sec, TINY if not sec.dry else DRY, "tiny: ")


def _fast_kernels(sec, shapes, tag: str) -> None:
    r, dev = Inputs(1), sec.device
    (K, N, C, rows), att, moe_shape = shapes
    for dt in (BF16, F32):
        w, b = r(N, K, dtype=dt, scale=K ** -0.5).to(dev), r(N).to(dev)
        x = r(rows, K, dtype=dt).to(dev)
        full = fl.linear(x, w, b, C)
        sec.check(f"{tag}linear {dt}: prefixes of 1, 2, 3, 16, 17, 64, 65 rows == the {rows}-row "
                  "call", all(same_bits(fl.linear(x[:m], w, b, C), full[:m])
                              for m in (1, 2, 3, 16, 17, 64, 65)))
        sec.check(f"{tag}linear {dt}: rows 0, 63, 64, {rows - 1} alone == in the batch",
                  all(same_bits(fl.linear(x[i:i + 1], w, b, C), full[i:i + 1])
                      for i in (0, 63, 64, rows - 1)))
        sec.check(f"{tag}linear {dt}: split 1, 2, 4, 8 give one result (4 rows)",
                  all(same_bits(fl.linear(x[:4], w, b, C, split=s), full[:4]) for s in (1, 2, 4, 8)))
        full32 = fl.linear(x[:17], w, None, C, F32)
        for t in (2, 4, 8):
            kt, nt = K // t, N // t
            parts = [fl.linear(x[:17, i * kt:(i + 1) * kt], w[:, i * kt:(i + 1) * kt].contiguous(),
                               None, C // t, F32) for i in range(t)]
            sec.check(f"{tag}linear {dt}: TP {t} row-parallel subtrees + tree == TP 1",
                      same_bits(tk.tree_sum(parts), full32)
                      and same_bits((tk.tree_sum(parts) + b).to(dt), full[:17]))
            cols = [fl.linear(x[:17], w[i * nt:(i + 1) * nt], b[i * nt:(i + 1) * nt], C)
                    for i in range(t)]
            sec.check(f"{tag}linear {dt}: TP {t} column shards == TP 1",
                      same_bits(torch.cat(cols, 1), full[:17]))
    _fast_attention(sec, r, att, tag)
    for dt in (BF16, F32):
        _fast_moe(sec, r, moe_shape, C, dt, tag)


def _fast_attention(sec, r, shape, tag: str) -> None:
    Hq, Hkv, D, B, lens = shape
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    for dt in (BF16, F32):
        T = sum(lens)
        q, k, v = (r(T, H, D, dtype=dt) for H in (Hq, Hkv, Hkv))
        kc, vc, table = _paged(k, v, cu, B)
        q, k, v, kc, vc, table, dcu = _to(sec.device, (q, k, v, kc, vc, table, cu))
        packed = fa.attention_varlen(q, k, v, dcu, D ** -0.5, B)
        s, n = len(lens) - 1, lens[-1]
        steps = [fa.attention_paged(q[int(cu[s]) + t:int(cu[s]) + t + 1], kc, vc, table,
                                    torch.tensor([s]), torch.tensor([t]), D ** -0.5)
                 for t in range(n)]
        sec.check(f"{tag}attention {dt}: every token of a {n}-token sequence decoded alone == prefill",
                  same_bits(torch.cat(steps), packed[int(cu[s]):]))
        chunk = list(range(7, min(47, n)))
        seq = torch.tensor([2, 0, 1] + [2] * len(chunk))
        pos = torch.tensor([n - 1, 0, lens[1] - 1] + chunk)
        got = fa.attention_paged(q[(cu[seq] + pos).to(sec.device)], kc, vc, table, seq, pos,
                                 D ** -0.5)
        sec.check(f"{tag}attention {dt}: a decode batch + a prefill chunk == the prefill's rows",
                  same_bits(got, packed[(cu[seq] + pos).to(sec.device)]))
        s0, s1 = int(cu[2]), int(cu[3])
        alone = fa.attention_varlen(q[s0:s1], k[s0:s1], v[s0:s1],
                                    torch.tensor([0, s1 - s0], device=sec.device), D ** -0.5, B)
        sec.check(f"{tag}attention {dt}: a sequence alone == packed with others",
                  same_bits(alone, packed[s0:s1]))


def _fast_moe(sec, r, shape, C: int, dt, tag: str) -> None:
    M, H, I, E, top = shape
    dev = sec.device
    gu = r(E, 2 * I, H, dtype=dt, scale=H ** -0.5).to(dev)
    dn = r(E, H, I, dtype=dt, scale=I ** -0.5).to(dev)
    x = r(M, H, dtype=dt).to(dev)
    ids = torch.stack([torch.randperm(E, generator=r.g)[:top] for _ in range(M)]).to(dev)
    y = fast_moe.moe_experts(x, ids, gu, dn, 0, C)
    rows = M * top // E
    for m in (0, M // 2, M - 1):
        one = fast_moe.moe_experts(x[m:m + 1], ids[m:m + 1], gu, dn, 0, C)
        sec.check(f"{tag}moe_experts {dt}: token {m} alone == in a batch of {M} (~{rows} rows "
                  "per expert)", same_bits(one[0], y[m]))
    e = int(ids[0, 0])  # the grouped kernel == the plain one: linear, silu_mul, linear
    g = fl.linear(x[:1], gu[e], None, C)
    h = rowwise.silu_mul_rows(g[:, :I], g[:, I:], torch.empty(1, I, dtype=dt, device=dev))
    sec.check(f"{tag}moe_experts {dt}: a slot == its expert as fast linear, silu_mul, fast "
              "linear", same_bits(fl.linear(h, dn[e], None, C)[0], y[0, 0]))
    half = E // 2
    ok = True
    for lo in (0, half):
        mi, ki = ((ids >= lo) & (ids < lo + half)).nonzero(as_tuple=True)
        got = fast_moe.moe_experts(x[mi], ids[mi, ki][:, None], gu[lo:lo + half],
                                   dn[lo:lo + half], lo, C)
        ok &= same_bits(got[:, 0], y[mi, ki])
    sec.check(f"{tag}moe_experts {dt}: EP 2 (two halves of the experts) == one call", ok)
