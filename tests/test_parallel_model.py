"""The model under tensor and expert parallelism gives the unsharded model's bits (CONTRACT.md 4).

One spawn of 4 gloo ranks walks every layout (TP in {1, 2, 4} x EP in {1, 2, 4}, DP filling the
rest of the 4 ranks): `init_parallel` makes each layout's groups in the same world. For each,
the ranks return what they computed; the test process computes the same with the single-process
model (same seed) and checks:
* the shards are the single-process weights' slices (seeded init, KV heads replicated at TP 4);
* forward logits, `token_logprobs`, the vocab-parallel argmax, greedy and sampled `generate`
  are bitwise equal to the single-process model's (fp32, and bf16 at TP 2 x EP 2);
* rollout at one layout scored by the training forward at the next layout: logdiff exactly 0;
* gradients of a loss over DP-split data match the single-process gradients (tolerance);
* twin: in "torch" kernel mode a TP 2 forward differs from TP 1 (gloo's all_reduce and a split
  stock matmul change the order), so the bitwise checks can fail;
* bad layouts raise clear errors; a raising rank fails the run fast; a save rank 0 refuses
  raises on every rank.
"""
from __future__ import annotations

import time

import pytest
import torch

import tonp_kernels as tk
from dist_utils import DistributedError, run_distributed

WORLD = 4
LAYOUTS = [(2, 1, "fp32"), (4, 1, "fp32"), (1, 2, "fp32"), (1, 4, "fp32"), (2, 2, "fp32"),
           (4, 4, "fp32"), (2, 4, "fp32"), (4, 2, "fp32"), (2, 2, "bf16")]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PROMPTS = [[3, 17, 200, 45], [250, 9], [11, 12, 13, 14, 15, 16, 17]]
NEW_TOKENS = 4
SAMPLING = dict(temperature=0.8, top_p=0.9, seed=5)
CHECKPOINT_LAYOUTS = [(4, 1), (2, 2), (2, 4)]


def _config(**kw):
    from tonp_models import Qwen3MoeConfig
    # Layer 0 sparse, layer 1 dense: both MLP kinds, KV heads 2 (replicated at TP 4).
    base = dict(num_hidden_layers=2, mlp_only_layers=[1], initializer_range=0.08,
                max_position_embeddings=128)
    return Qwen3MoeConfig.preset("tiny", **{**base, **kw})


def _seqs():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 320, (n,), generator=g) for n in (6, 11, 3, 8)]


def _outputs(model, seqs, prev_rollout):
    """Everything a layout is compared on (the same calls on every rank of every layout)."""
    from tonp_models import generate
    ids, cu = torch.cat(seqs), torch.tensor([0, 6, 17, 20, 28], dtype=torch.int32)
    with torch.no_grad():
        logits = model(ids, cu)
        lps = model.token_logprobs(seqs, micro_batch_size=3)
        h = model(ids, cu, return_hidden=True)
        argmax = model.lm_head.argmax(h)
    greedy = generate(model, PROMPTS, NEW_TOKENS)
    sampled = generate(model, PROMPTS, NEW_TOKENS, **SAMPLING)
    out = dict(logits=logits, lps=lps, argmax=argmax, greedy=greedy, sampled=sampled)
    if prev_rollout is not None:  # the previous layout's rollout, scored by this one's training
        with torch.no_grad():
            out["rescored"] = model.token_logprobs(prev_rollout.sequences,
                                                   temperature=SAMPLING["temperature"])
    return out


def _grads(model, seqs, g):
    """Loss over this DP rank's share of the sequences -> {name: local grad}."""
    model.zero_grad(set_to_none=True)
    mine = seqs[g.dp_rank::g.dp_size]
    torch.cat(model.token_logprobs(mine)).sum().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _layouts_rank(ckpt: str):
    import tonp_parallel as tpar
    from tonp_models import Qwen3MoeForCausalLM
    results, prev = [], None
    seqs = _seqs()
    for tp, ep, dt in LAYOUTS:
        g = tpar.init_parallel(tp=tp, ep=ep)
        dtype = DTYPES[dt]
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(_config(), dtype=dtype, groups=g)
        r = dict(layout=(tp, ep, dt), rank=g.rank, tp_rank=g.tp_rank, dp_rank=g.dp_rank,
                 shards=model.parameter_shards(),
                 params={n: p.detach().clone() for n, p in model.named_parameters()})
        r.update(_outputs(model, seqs, prev if dt == "fp32" else None))
        if (tp, ep) in CHECKPOINT_LAYOUTS:  # sharded load and gathered save
            loaded = Qwen3MoeForCausalLM.from_pretrained(f"{ckpt}/{dt}", groups=g)
            r["loaded"] = {n: p.detach().clone() for n, p in loaded.named_parameters()}
            model.save_pretrained(f"{ckpt}/saved_{tp}_{ep}_{dt}")
        if dt == "fp32":
            r["grads"] = _grads(model, seqs, g)
            prev = r["sampled"]
        results.append(r)

    # Twin: stock torch ops and gloo's own all_reduce at TP 2 vs the stock TP 1 model.
    g = tpar.init_parallel(tp=2, ep=1)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(_config(), groups=g)
    with tk.use("torch"), torch.no_grad():
        ids = torch.cat(seqs)
        twin = model(ids, torch.tensor([0, len(ids)], dtype=torch.int32))

    errors = {}
    for name, kw, layout in [("experts", dict(num_experts=6), (1, 4)),
                             ("heads", dict(num_attention_heads=2, num_key_value_heads=2), (4, 1)),
                             ("chunks", dict(reduction_chunks=2), (4, 1))]:
        try:
            Qwen3MoeForCausalLM(_config(**kw), groups=tpar.init_parallel(*layout))
        except ValueError as e:
            errors[name] = str(e)
    try:
        tpar.init_parallel(tp=3)
    except ValueError as e:
        errors["world"] = str(e)
    errors["save"] = _failed_save(ckpt)
    return dict(layouts=results, twin=twin, errors=errors)


def _failed_save(ckpt: str) -> str:
    """A TP 2 x EP 2 save into a directory rank 0 refuses (a foreign weight file): what each
    rank raised."""
    import os

    import torch.distributed as dist

    import tonp_parallel as tpar
    from tonp_models import Qwen3MoeForCausalLM
    g = tpar.init_parallel(tp=2, ep=2)
    model = Qwen3MoeForCausalLM(_config(), groups=g)
    target = os.path.join(ckpt, "foreign")
    if g.rank == 0:
        os.makedirs(target, exist_ok=True)
        with open(os.path.join(target, "pytorch_model.bin"), "wb") as f:
            f.write(b"someone else's weights")
    dist.barrier()
    try:
        model.save_pretrained(target)
    except (ValueError, RuntimeError) as e:  # the outcome under test, returned to the parent
        return f"{type(e).__name__}: {e}"
    return "saved"


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    """The single-process models saved in the hub layout (fp32 and bf16)."""
    path = tmp_path_factory.mktemp("parallel_ckpt")
    for dt, dtype in DTYPES.items():
        _reference(dtype).save_pretrained(path / dt)
    return path


@pytest.fixture(scope="module")
def spawned(ckpt_dir):
    return run_distributed(_layouts_rank, WORLD, str(ckpt_dir), timeout=600)


def _reference(dtype):
    from tonp_models import Qwen3MoeForCausalLM
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(_config(), dtype=dtype)


def _assert_same_rollout(a, b, what):
    assert len(a.sequences) == len(b.sequences), what
    for x, y in zip(a.sequences, b.sequences):
        assert torch.equal(x, y), f"{what}: tokens {x.tolist()} vs {y.tolist()}"
    for x, y in zip(a.logprobs, b.logprobs):
        assert torch.equal(x, y), f"{what}: logprobs differ by {(x - y).abs().max()}"


def test_every_layout_equals_the_single_process_model(spawned):
    """TP x EP up to 4 ranks: shards, logits, token_logprobs, argmax, generate: torch.equal."""
    refs = {dt: _reference(dtype) for dt, dtype in DTYPES.items()}
    seqs = _seqs()
    expected = {dt: _outputs(m, seqs, None) for dt, m in refs.items()}
    for rank_out in spawned:
        for r in rank_out["layouts"]:
            what = f"layout tp={r['layout'][0]} ep={r['layout'][1]} {r['layout'][2]} " \
                   f"rank {r['rank']}"
            ref, exp = refs[r["layout"][2]], expected[r["layout"][2]]
            for n, p in ref.named_parameters():
                shard = r["shards"].get(n)
                assert torch.equal(r["params"][n], shard.take(p) if shard else p), \
                    f"{what}: {n} is not the single-process weight's shard"
            assert torch.equal(r["logits"], exp["logits"]), f"{what}: logits"
            for a, b in zip(r["lps"], exp["lps"]):
                assert torch.equal(a, b), f"{what}: token_logprobs differ by {(a - b).abs().max()}"
            assert torch.equal(r["argmax"], tk.argmax(exp["logits"])), f"{what}: argmax"
            _assert_same_rollout(r["greedy"], exp["greedy"], f"{what}: greedy generate")
            _assert_same_rollout(r["sampled"], exp["sampled"], f"{what}: sampled generate")


def test_sharded_load_and_gathered_save(spawned, ckpt_dir):
    """from_pretrained under TP/EP reads each rank's slices (KV copies, vocab rows, expert
    ranges) = the seeded shards; save_pretrained gathers to the single-process hub files."""
    from safetensors.torch import load_file
    checked = 0
    for rank_out in spawned:
        for r in rank_out["layouts"]:
            if "loaded" not in r:
                continue
            for n, p in r["params"].items():
                assert torch.equal(r["loaded"][n], p), f"{r['layout']} rank {r['rank']}: {n}"
            checked += 1
    assert checked == WORLD * (len(CHECKPOINT_LAYOUTS) + 1)
    for dt in DTYPES:
        want = load_file(ckpt_dir / dt / "model.safetensors")
        for tp, ep in CHECKPOINT_LAYOUTS:
            if (tp, ep, dt) not in LAYOUTS:
                continue
            got = load_file(ckpt_dir / f"saved_{tp}_{ep}_{dt}" / "model.safetensors")
            assert got.keys() == want.keys()
            for k in want:
                assert torch.equal(got[k], want[k]), f"saved at tp={tp} ep={ep} {dt}: {k}"


def test_rollout_at_one_layout_scores_identically_at_another(spawned):
    """Layout i's sampled rollout, scored by layout i+1's training forward: logdiff exactly 0."""
    layouts = [r for r in spawned[0]["layouts"] if r["layout"][2] == "fp32"]
    checked = 0
    for prev, cur in zip(layouts, layouts[1:]):
        roll = prev["sampled"]
        for lp, gen_lp, p in zip(cur["rescored"], roll.logprobs, roll.prompt_lengths):
            logdiff = (lp[p - 1:] - gen_lp).abs().max().item() if len(gen_lp) else 0.0
            assert torch.equal(lp[p - 1:], gen_lp), \
                f"rollout at {prev['layout']} vs training at {cur['layout']}: logdiff {logdiff}"
            checked += len(gen_lp)
    assert checked > 0


def _assemble(results, name, full_like, tp, ep):
    """The full gradient from every rank's local one: within a group of ranks holding disjoint
    slices (a TP group; an EP group for experts) slices are placed, across groups (DP replicas
    with different data) summed; EP groups that cover the same tokens (ep < tp) are averaged."""
    shard = results[0]["shards"].get(name)
    by_ep = shard is not None and shard.group == "ep"
    width = ep if by_ep else tp
    total = torch.zeros_like(full_like, dtype=torch.float64)
    for start in range(0, WORLD, width):
        part = torch.zeros_like(total)
        for r in results[start:start + width]:
            s = r["shards"].get(name)
            (s.take(part) if s else part).copy_(r["grads"][name].double())
        total += part
    return total / (max(1, tp // ep) if by_ep else 1)


def test_gradients_match_the_single_process_model(spawned):
    """Each DP replica scores its share of the data; the assembled gradients equal the
    single-process gradients of the whole batch (fp32 tolerance; backward is stock math)."""
    ref = _reference(torch.float32)
    torch.cat(ref.token_logprobs(_seqs())).sum().backward()
    for i, (tp, ep, dt) in enumerate(LAYOUTS):
        if dt != "fp32":
            continue
        results = sorted((out["layouts"][i] for out in spawned), key=lambda r: r["rank"])
        for n, p in ref.named_parameters():
            got = _assemble(results, n, p, tp, ep).float()
            torch.testing.assert_close(got, p.grad, rtol=2e-4, atol=2e-5,
                                       msg=lambda m: f"tp={tp} ep={ep} {n}: {m}")


def test_twin_stock_torch_tp2_differs_from_tp1(spawned):
    """Proof the bitwise checks can fail: stock ops at TP 2 (split matmuls, gloo all_reduce)
    give other bits than stock TP 1 for some token."""
    ref = _reference(torch.float32)
    ids = torch.cat(_seqs())
    with tk.use("torch"), torch.no_grad():
        single = ref(ids, torch.tensor([0, len(ids)], dtype=torch.int32))
    twin = spawned[0]["twin"]
    assert torch.allclose(twin, single, rtol=1e-3, atol=1e-4)
    assert not torch.equal(twin, single)


def test_bad_layouts_raise_clear_errors(spawned):
    errors = spawned[0]["errors"]
    assert "ep=4 must divide the 6 experts" in errors["experts"]
    assert "tp=4 must divide the 2 query heads" in errors["heads"]
    assert "tp=4 must divide the reduction chunks C=2" in errors["chunks"]
    assert "not divisible by tp=3" in errors["world"]


def test_a_failed_sharded_save_raises_on_every_rank(spawned):
    """Rank 0 writes; when it cannot, every rank raises instead of waiting in a barrier."""
    for rank, out in enumerate(spawned):
        msg = out["errors"]["save"]
        want = "ValueError: save_pretrained" if rank == 0 else \
            "RuntimeError: save_checkpoint: global rank 0 failed"
        assert msg.startswith(want) and "pytorch_model.bin" in msg, (rank, msg)


def _raise_on_rank_1():
    import torch.distributed as dist
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 broke")
    dist.barrier()  # rank 0 would wait here forever without the harness's fail-fast
    return "unreachable"


def test_a_raising_rank_fails_fast():
    start = time.monotonic()
    with pytest.raises(DistributedError, match="rank 1 broke"):
        run_distributed(_raise_on_rank_1, 2, timeout=120)
    assert time.monotonic() - start < 100
