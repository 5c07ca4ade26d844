"""tonp_parallel: the fixed-order all-reduce gives the same bits for every message size, on every
rank, and equals the single-process tree; gloo's own all-reduce does not; the autograd pairs
give the right gradients; bad layouts fail clearly; a failing rank fails the run fast.

Process spawns cost seconds each, so one spawned run per world size does every check and the
parent process compares the results.
"""
import os
import time

import pytest
import torch
import torch.distributed as dist

import tonp_kernels as tk
import tonp_parallel as tpar
from dist_utils import DistributedError, run_distributed

# name -> shape. 20000 fp32 = 80 KB > SMALL_MESSAGE_BYTES: "auto" takes the all_to_all form.
SIZES = {"one": (1,), "odd7": (7,), "k1": (1000,), "large": (20000,), "3d": (3, 5, 7)}
ALGOS = ("auto", "gather", "all_to_all")


def _partial(rank: int, shape) -> torch.Tensor:
    """Rank `rank`'s fp32 partial: mixed signs, magnitudes 1..1e7, so the summation order shows."""
    g = torch.Generator().manual_seed(1000 + rank)
    n = int(torch.tensor(shape).prod())
    scale = 10.0 ** torch.randint(0, 8, (n,), generator=g)
    return (torch.randn(n, generator=g) * scale).float().reshape(shape)


def _grad_checks(rank: int, W: int, group):
    """Each autograd pair on a small problem; the parent redoes it in one process."""
    g = torch.Generator().manual_seed(7)
    X, W1, W2 = (torch.randn(4, 8, generator=g), torch.randn(4 * W, 8, generator=g),
                 torch.randn(8, 4 * W, generator=g))
    out = {}
    # Column-parallel W1 then row-parallel W2: copy_to_region ... reduce_from_region.
    x = X.clone().requires_grad_()
    w1 = W1[4 * rank:4 * (rank + 1)].clone().requires_grad_()
    w2 = W2[:, 4 * rank:4 * (rank + 1)].clone().requires_grad_()
    y = tpar.reduce_from_region(tpar.copy_to_region(x, group) @ w1.T @ w2.T, group)
    (y * torch.arange(y.numel()).view(y.shape)).sum().backward()
    out["mlp"] = (y.detach(), x.grad, w1.grad, w2.grad)

    G = torch.randn(3, 2 * W, generator=g)  # a fixed upstream gradient for the dim-wise pairs
    a = torch.full((3, 2), float(rank + 1), requires_grad=True)
    (tpar.gather_from_region(a, group, dim=1) * G).sum().backward()
    out["gather"] = a.grad
    b = torch.arange(3.0 * 2 * W).view(3, 2 * W).requires_grad_()
    piece = tpar.scatter_to_region(b, group, dim=1)
    (piece * G[:, 2 * rank:2 * rank + 2]).sum().backward()
    out["scatter"] = (piece.detach(), b.grad)
    c = _partial(rank, (2, 2 * W)).requires_grad_()
    rs = tpar.reduce_scatter_to_region(c, group, dim=1)
    (rs * G[:2, 2 * rank:2 * rank + 2]).sum().backward()
    out["reduce_scatter"] = (rs.detach(), c.grad)
    d = torch.tensor([float(rank), 2.0 * rank], requires_grad=True)
    (tpar.gather_partials(d, group) * torch.arange(2.0 * W).view(W, 2)).sum().backward()
    out["partials"] = d.grad

    # Uneven expert-style dispatch: rank r sends (r + j) % 3 + 1 rows to rank j.
    ins = [(rank + j) % 3 + 1 for j in range(W)]
    counts = tpar.all_to_all(torch.tensor(ins), group=group)  # exchange the counts first
    rows = 100.0 * rank + torch.arange(float(sum(ins)))
    e = torch.stack([rows, -rows], 1).requires_grad_()
    recv = tpar.all_to_all(e, counts.tolist(), ins, group)
    (recv * torch.arange(1.0, 1.0 + recv.numel()).view(recv.shape)).sum().backward()
    out["all_to_all"] = (counts, recv.detach(), e.grad)
    return out


def _error_checks(group):
    errs = {}
    cases = {
        "bf16": lambda: tpar.tree_all_reduce(torch.ones(4, dtype=torch.bfloat16), group),
        "rs_indivisible": lambda: tpar.tree_reduce_scatter(torch.ones(3, 5), group, dim=1),
        "a2a_splits": lambda: tpar.all_to_all(torch.ones(4, 2), [1] * 3, [4], group),
        "algorithm": lambda: tpar.tree_all_reduce(torch.ones(4), group, algorithm="ring"),
    }
    for name, fn in cases.items():
        try:
            fn()
            errs[name] = None
        except (TypeError, ValueError) as e:
            errs[name] = f"{type(e).__name__}: {e}"
    return errs


def _megatron_checks(W):
    """Adopt megatron-core's groups; its rank generator must agree with `rank_layout`."""
    try:
        import warnings
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state as ps
    except ImportError:
        return None
    layouts_agree = True
    for world, tp, ep, etp in [(4, 2, 2, 1), (4, 2, 2, 2), (8, 2, 4, 1), (8, 4, 2, 1), (8, 1, 8, 1)]:
        mine = tpar.rank_layout(world, tp, ep, etp)
        dense = ps.RankGenerator(tp=tp, ep=1, dp=world // tp, pp=1, cp=1, order="tp-cp-ep-dp-pp")
        expert = ps.RankGenerator(tp=etp, ep=ep, dp=world // (ep * etp), pp=1, cp=1,
                                  order="tp-cp-ep-dp-pp")
        pairs = [(dense, "tp", mine.tp_groups), (dense, "dp", mine.dp_groups),
                 (expert, "ep", mine.ep_groups), (expert, "tp", mine.expert_tp_groups),
                 (expert, "dp", mine.expert_dp_groups)]
        layouts_agree &= all([tuple(r) for r in gen.get_ranks(k)] == ours for gen, k, ours in pairs)
    ps.initialize_model_parallel(tensor_model_parallel_size=W, expert_model_parallel_size=W,
                                 expert_tensor_parallel_size=1)
    try:
        groups = tpar.ParallelGroups.from_megatron()
        summed = tpar.tree_all_reduce(_partial(dist.get_rank(), (33,)), groups.tp_group)
        fields = (groups.tp_rank, groups.tp_size, groups.ep_rank, groups.ep_size, groups.dp_size)
    finally:
        ps.destroy_model_parallel()
    return layouts_agree, fields, summed


def _rank_main(with_megatron: bool):
    rank, W = dist.get_rank(), dist.get_world_size()
    world = dist.group.WORLD
    res = {"tree": {}, "gloo": {}}
    for name, shape in SIZES.items():
        x = _partial(rank, shape)
        res["tree"][name] = {a: tpar.tree_all_reduce(x, world, algorithm=a) for a in ALGOS}
        y = x.clone()
        dist.all_reduce(y)
        res["gloo"][name] = y
    head = _partial(rank, SIZES["k1"])[:8].clone()  # gloo on the first 8 elements alone
    dist.all_reduce(head)
    res["gloo_head"] = head
    x = _partial(rank, (6, 4 * W))
    res["rs"] = (tpar.tree_reduce_scatter(x, world, 0) if 6 % W == 0 else None,
                 tpar.tree_reduce_scatter(x, world, 1))
    with tk.use("torch"):
        res["stock_region"] = tpar.reduce_from_region(_partial(rank, (1000,)), world)
        res["stock_rs"] = tpar.reduce_scatter_to_region(x, world, 1)

    # Row-parallel linear on TP = W: the kernel's subtree partial, then the fixed tree.
    g = torch.Generator().manual_seed(3)
    act, weight = torch.randn(5, 64, generator=g), torch.randn(16, 64, generator=g)
    k = 64 // W
    part = tk.linear_partial(act[:, rank * k:(rank + 1) * k], weight[:, rank * k:(rank + 1) * k],
                             chunks=tk.DEFAULT_CHUNKS // W)
    res["row_parallel"] = tpar.reduce_from_region(part, world)

    groups = tpar.init_parallel(tp=2, ep=2)  # sub-groups when W = 4
    res["groups"] = (groups.tp_rank, groups.tp_size, groups.ep_rank, groups.ep_size,
                     groups.dp_rank, groups.dp_size, list(groups.local_experts(8)))
    res["tp_tree"] = tpar.tree_all_reduce(_partial(rank, (50,)), groups.tp_group)
    res["groups_reused"] = tpar.init_parallel(tp=2, ep=1).tp_group is groups.tp_group
    if W == 4:  # expert_tp = 2: EP groups take every other rank, {0, 2} and {1, 3}
        strided = tpar.init_parallel(tp=2, ep=2, expert_tp=2)
        res["ep_tree"] = tpar.tree_all_reduce(_partial(rank, (50,)), strided.ep_group,
                                              algorithm="all_to_all")
        res["strided_ep_rank"] = strided.ep_rank
    res["grads"] = _grad_checks(rank, W, world)
    res["errors"] = _error_checks(world)
    res["megatron"] = _megatron_checks(W) if with_megatron else None
    return res


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def world(request):
    W = request.param
    return W, run_distributed(_rank_main, W, W == 2, timeout=180)


@pytest.mark.timeout(240)
def test_tree_all_reduce_same_bits_every_size_rank_and_form(world):
    W, res = world
    for name, shape in SIZES.items():
        expected = tk.tree_sum([_partial(r, shape) for r in range(W)])  # single-process tree
        for rank in range(W):
            for algo, got in res[rank]["tree"][name].items():
                assert torch.equal(got, expected), (name, rank, algo)
    assert tpar.SMALL_MESSAGE_BYTES < 20000 * 4 and 1000 * 4 < tpar.SMALL_MESSAGE_BYTES


@pytest.mark.timeout(240)
def test_gloo_all_reduce_is_not_the_fixed_order(world):
    """The twin that proves the bitwise checks can fail: gloo's own sum order differs."""
    W, res = world
    if W == 2:
        pytest.skip("two fp32 partials: p0 + p1 == p1 + p0, every order gives the same bits")
    expected = tk.tree_sum([_partial(r, SIZES["k1"]) for r in range(W)])
    gloo = res[0]["gloo"]["k1"]
    assert not torch.equal(gloo, expected)  # a different order than the contract's tree
    assert torch.allclose(gloo, expected, rtol=0, atol=1e-3 * float(expected.abs().max()))
    # and gloo's bits depend on the message size: the same 8 elements all-reduced alone differ
    assert not torch.equal(res[0]["gloo_head"], gloo[:8])
    for rank in range(W):  # while the fixed tree gives the same bits for both sizes
        assert torch.equal(res[rank]["tree"]["k1"]["auto"][:8], expected[:8])


@pytest.mark.timeout(240)
def test_reduce_scatter_and_region_modes(world):
    W, res = world
    x_all = [_partial(r, (6, 4 * W)) for r in range(W)]
    full = tk.tree_sum(x_all)
    for rank in range(W):
        rs0, rs1 = res[rank]["rs"]
        if rs0 is not None:
            assert torch.equal(rs0, full.chunk(W, 0)[rank])
        assert torch.equal(rs1, full.chunk(W, 1)[rank])
        torch.testing.assert_close(res[rank]["stock_rs"], rs1, rtol=0, atol=64.0)  # |x| <= 1e8
        assert torch.equal(res[rank]["stock_region"], res[rank]["gloo"]["k1"])  # "torch" mode
    g = torch.Generator().manual_seed(3)
    act, weight = torch.randn(5, 64, generator=g), torch.randn(16, 64, generator=g)
    tp1 = tk.linear(act, weight, out_dtype=torch.float32)  # TP = 1: one kernel, whole tree
    for rank in range(W):
        assert torch.equal(res[rank]["row_parallel"], tp1), rank


@pytest.mark.timeout(240)
def test_groups_follow_the_documented_layout(world):
    W, res = world
    layout = tpar.rank_layout(W, tp=2, ep=2)
    for rank in range(W):
        tp_ranks, ep_ranks = layout.group_of("tp", rank), layout.group_of("ep", rank)
        dp_ranks = layout.group_of("dp", rank)
        experts = list(range(ep_ranks.index(rank) * 4, ep_ranks.index(rank) * 4 + 4))
        assert res[rank]["groups"] == (tp_ranks.index(rank), 2, ep_ranks.index(rank), 2,
                                       dp_ranks.index(rank), W // 2, experts)
        assert res[rank]["groups_reused"]  # a second init_parallel makes no new communicator
        members = [_partial(r, (50,)) for r in tp_ranks]
        assert torch.equal(res[rank]["tp_tree"], tk.tree_sum(members))
        if W == 4:
            strided = tpar.rank_layout(4, tp=2, ep=2, expert_tp=2).group_of("ep", rank)
            assert strided == (rank % 2, rank % 2 + 2)
            assert res[rank]["strided_ep_rank"] == rank // 2
            assert torch.equal(res[rank]["ep_tree"],
                               tk.tree_sum([_partial(r, (50,)) for r in strided]))


@pytest.mark.timeout(240)
def test_autograd_pairs_give_the_right_gradients(world):
    W, res = world
    g = torch.Generator().manual_seed(7)
    X, W1, W2 = (torch.randn(4, 8, generator=g), torch.randn(4 * W, 8, generator=g),
                 torch.randn(8, 4 * W, generator=g))
    G = torch.randn(3, 2 * W, generator=g)
    x, w1, w2 = (t.clone().requires_grad_() for t in (X, W1, W2))
    y = x @ w1.T @ w2.T
    (y * torch.arange(y.numel()).view(y.shape)).sum().backward()
    c_all = [_partial(r, (2, 2 * W)) for r in range(W)]
    for rank in range(W):
        out = res[rank]["grads"]
        y_r, gx, gw1, gw2 = out["mlp"]
        torch.testing.assert_close(y_r, y.detach(), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(gx, x.grad, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(gw1, w1.grad[4 * rank:4 * rank + 4], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(gw2, w2.grad[:, 4 * rank:4 * rank + 4], rtol=1e-5, atol=1e-4)
        assert torch.equal(out["gather"], G[:, 2 * rank:2 * rank + 2])
        piece, gb = out["scatter"]
        assert torch.equal(piece, torch.arange(6.0 * W).view(3, 2 * W)[:, 2 * rank:2 * rank + 2])
        assert torch.equal(gb, G)
        rs, gc = out["reduce_scatter"]
        assert torch.equal(rs, tk.tree_sum(c_all)[:, 2 * rank:2 * rank + 2])
        assert torch.equal(gc, G[:2])
        assert torch.equal(out["partials"], torch.arange(2.0 * W).view(W, 2)[rank])
        # all_to_all: rows from rank j arrive in rank order; grads travel back to their senders
        counts, recv, ge = out["all_to_all"]
        sent = [[(j + r) % 3 + 1 for r in range(W)] for j in range(W)]  # sent[j][r]: j -> r
        assert counts.tolist() == [sent[j][rank] for j in range(W)]
        expected = []
        for j in range(W):
            start = sum(sent[j][:rank])
            rows = 100.0 * j + torch.arange(float(start), float(start + sent[j][rank]))
            expected.append(torch.stack([rows, -rows], 1))
        assert torch.equal(recv, torch.cat(expected))
    for rank in range(W):  # rank r's e.grad = the loss weights its rows met at their receivers
        ge = res[rank]["grads"]["all_to_all"][2]
        ins = [(rank + j) % 3 + 1 for j in range(W)]
        pieces = []
        for j in range(W):
            recv_j = res[j]["grads"]["all_to_all"][1]
            weights = torch.arange(1.0, 1.0 + recv_j.numel()).view(recv_j.shape)
            start = sum((i + j) % 3 + 1 for i in range(rank))
            pieces.append(weights[start:start + ins[j]])
        assert torch.equal(ge, torch.cat(pieces))


@pytest.mark.timeout(240)
def test_bad_inputs_raise_clear_errors(world):
    W, res = world
    errs = res[0]["errors"]
    assert "float32" in errs["bf16"]
    assert "not divisible by the group size" in errs["rs_indivisible"]
    assert "one per rank" in errs["a2a_splits"]
    assert "algorithm must be one of" in errs["algorithm"]


@pytest.mark.timeout(240)
def test_megatron_groups_are_adopted(world):
    W, res = world
    if W != 2 or res[0]["megatron"] is None:
        pytest.skip("checked once, at world 2, when megatron-core is installed")
    expected = tk.tree_sum([_partial(r, (33,)) for r in range(W)])
    for rank in range(W):
        layouts_agree, fields, summed = res[rank]["megatron"]
        assert layouts_agree, "rank_layout disagrees with megatron-core's RankGenerator"
        assert fields == (rank, 2, rank, 2, 1)
        assert torch.equal(summed, expected)


# ------------------------------------------------------------------ single-process checks
def test_tree_order_is_the_contract_tree():
    parts = [_partial(r, (257,)) for r in range(8)]
    for n in (1, 2, 4, 8):
        assert torch.equal(tpar.tree_order_sum(parts[:n]), tk.tree_sum(parts[:n]))
    p = parts
    assert torch.equal(tpar.tree_order_sum(p[:3]), (p[0] + p[1]) + p[2])
    assert torch.equal(tpar.tree_order_sum(p[:6]), ((p[0] + p[1]) + (p[2] + p[3])) + (p[4] + p[5]))


def test_single_process_groups_are_identities():
    groups = tpar.ParallelGroups.single()
    assert (groups.tp_size, groups.ep_size, groups.dp_size, groups.tp_group) == (1, 1, 1, None)
    assert list(groups.local_experts(8)) == list(range(8))
    x = _partial(0, (3, 4))
    assert torch.equal(tpar.tree_all_reduce(x, None), x)
    assert tpar.reduce_from_region(x, None) is x and tpar.copy_to_region(x, None) is x
    assert torch.equal(tpar.all_to_all(x, [3], [3], None), x)
    assert tpar.gather_partials(x, None).shape == (1, 3, 4)


def test_bad_layouts_raise_clear_errors():
    with pytest.raises(ValueError, match="not divisible by tp=3"):
        tpar.rank_layout(4, tp=3)
    with pytest.raises(ValueError, match="ep x expert_tp = 4 x 2"):
        tpar.rank_layout(4, tp=2, ep=4, expert_tp=2)
    qwen3_30b = dict(num_attention_heads=32, num_key_value_heads=4, head_dim=128, hidden_size=2048,
                     intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                     vocab_size=151936, reduction_chunks=8)
    for tp, ep in [(1, 1), (2, 4), (4, 8), (8, 128)]:
        tpar.validate_model_layout(qwen3_30b, tp=tp, ep=ep)  # tp 8 > 4 KV heads: replicated
    with pytest.raises(ValueError, match="must divide the reduction chunks C=8"):
        tpar.validate_model_layout(qwen3_30b, tp=16)
    with pytest.raises(ValueError, match="ep=3 must divide the 128 experts"):
        tpar.validate_model_layout(qwen3_30b, ep=3)
    odd = dict(qwen3_30b, num_attention_heads=6, num_key_value_heads=3, head_dim=16)
    with pytest.raises(ValueError) as e:
        tpar.validate_model_layout(odd, tp=4)
    assert "must divide the 6 query heads" in str(e.value)
    assert "divide the 3 KV heads or be a multiple of them" in str(e.value)
    with pytest.raises(RuntimeError, match="torchrun"):
        tpar.init_parallel(tp=2)


@pytest.mark.timeout(60)
def test_a_failing_rank_fails_the_run_fast():
    start = time.monotonic()
    with pytest.raises(DistributedError, match="rank 1 failed") as e:
        run_distributed(_rank1_raises, 2, timeout=45, init=False)
    assert "ValueError: rank 1 is broken" in str(e.value)
    assert time.monotonic() - start < 30  # rank 0 was blocked in a collective: not waited for


@pytest.mark.timeout(60)
def test_a_hanging_run_times_out():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not finish within 8s"):
        run_distributed(time.sleep, 2, 600, timeout=8)
    assert time.monotonic() - start < 20


def _rank1_raises():
    groups = tpar.init_parallel(tp=2)  # from torchrun's environment, as under torchrun
    if groups.tp_rank == 1:
        raise ValueError("rank 1 is broken")
    tpar.tree_all_reduce(torch.ones(3), groups.tp_group)  # would wait forever for rank 1


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _teardown_threads(plain: bool):
    """(threads before init_parallel, with its groups live, after the teardown) on this rank."""
    torch.ones(64, 64) @ torch.ones(64, 64)   # the intra-op pool exists before the count
    before = _threads()
    groups = tpar.init_parallel(tp=2, ep=2)
    tpar.tree_all_reduce(torch.ones(3), groups.tp_group)
    live = _threads()
    groups = None
    if plain:
        dist.destroy_process_group()
        after = _threads()
        tpar.destroy_parallel()          # this rank still ends cleanly
    else:
        tpar.destroy_parallel()
        after = _threads()
    return before, live, after


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
@pytest.mark.timeout(120)
def test_destroy_parallel_joins_gloo_threads_before_the_interpreter_exits():
    """destroy_parallel stops every gloo worker thread at once; destroy_process_group alone
    leaves those of init_parallel's groups running into the interpreter's teardown, where a
    serve follower rank once aborted ("terminate called without an active exception")."""
    for (before, live, after) in run_distributed(_teardown_threads, 2, False, timeout=90,
                                                 init=False):
        assert live > before and after == before, (before, live, after)
    for (before, live, after) in run_distributed(_teardown_threads, 2, True, timeout=90,
                                                 init=False):
        assert after > before, ("destroy_process_group alone joined gloo's threads: the twin "
                                "no longer shows why destroy_parallel exists", before, after)
