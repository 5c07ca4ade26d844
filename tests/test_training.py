"""tonp_models.training as a library: master weights, the optimizer schedule, gradient averaging
and clipping over TP / EP shards (equal to one process), bit-exact resume through Trainer, the
metric logger (a torn last line is dropped with a warning), and --dist-timeout (a stalled rank
fails its peers after that many seconds instead of torch's 10 minutes)."""
from __future__ import annotations

import argparse
import functools
import json
import math
import re
import time

import pytest
import torch

import tonp_parallel as tpar
from tonp_models import Qwen3MoeConfig
from tonp_models.training import (GradSync, MasterWeights, MetricLogger, Trainer, build_model,
                                  build_optimizer, expert_grad_divisor, lm_loss, read_jsonl,
                                  warmup_cosine)
from tonp_models.training.cli import add_launch_args, launch
from tonp_parallel.launch import DistributedError, run_distributed

# One layer, one KV head: at TP 2 both ranks hold a copy of it (the norm must count it once).
CONFIG = dict(num_hidden_layers=1, num_key_value_heads=1)


def _tiny(dtype=torch.float32, groups=None, seed=0):
    return build_model(Qwen3MoeConfig.preset("tiny", **CONFIG), dtype,
                       groups or tpar.ParallelGroups.single(), seed)


def _batch(n=4, length=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, length + 1), generator=g)


# -- master weights and the optimizer -------------------------------------------------------------
def test_master_weights_round_trip_bf16():
    model = _tiny(torch.bfloat16)
    master = MasterWeights(model)
    assert master.separate and all(m.dtype == torch.float32 for m in master.params)
    for m, p in zip(master.params, master.model_params):
        assert torch.equal(m, p.float())                 # bf16 -> fp32 is exact
    lm_loss(model, _batch()).backward()
    master.grads_to_master()
    assert all(m.grad is not None and m.grad.dtype == torch.float32 for m in master.params)
    with torch.no_grad():
        for m in master.params:
            m.add_(1e-3)                                 # an update bf16 cannot hold exactly
    master.master_to_model()
    for m, p in zip(master.params, master.model_params):
        assert torch.equal(p, m.to(torch.bfloat16))      # the model holds the rounded master
    state = master.state_dict()
    other = MasterWeights(_tiny(torch.bfloat16))
    other.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(other.params, master.params))
    with pytest.raises(KeyError, match="no fp32 master copy of"):
        other.load_state_dict({})
    bad = {k: v[:1] for k, v in state.items()}
    with pytest.raises(ValueError, match="has shape"):
        other.load_state_dict(bad)
    assert not MasterWeights(_tiny()).separate           # fp32: the parameters themselves


def test_optimizer_and_schedule():
    master = MasterWeights(_tiny())
    opt = build_optimizer(master, lr=1e-3, weight_decay=0.1)
    decay, no_decay = opt.param_groups
    assert all(p.dim() >= 2 for p in decay["params"]) and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 1 for p in no_decay["params"])
    f = warmup_cosine(warmup=4, total=14, min_ratio=0.1)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(9) == pytest.approx(0.55) and f(14) == pytest.approx(0.1) == f(100)
    with pytest.raises(ValueError, match="lr must be a finite number"):
        build_optimizer(master, lr=float("nan"))
    with pytest.raises(ValueError, match="min_ratio"):
        warmup_cosine(2, 10, min_ratio=2.0)


# -- gradient sync and clipping over shards -------------------------------------------------------
def test_expert_grad_divisor():
    """world 8, tp 4, ep 2, dp 2: the expert-DP group {0, 2, 4, 6} holds two copies of each
    TP group's expert gradient (EP groups {0, 1} and {2, 3} both see TP group 0's batch)."""
    assert expert_grad_divisor(dp_size=2, tp_size=4, ep_size=2) == 4
    assert expert_grad_divisor(dp_size=2, tp_size=1, ep_size=2) == 2   # one EP group per batch
    assert expert_grad_divisor(dp_size=1, tp_size=2, ep_size=2) == 1


LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]       # (tp, ep) on 2 ranks; dp = 2 / tp


def _full_grads(model, master, groups):
    """Every master gradient, gathered into the full tensor from its shards."""
    shards, out = model.parameter_shards(), {}
    size = {"tp": groups.tp_size, "ep": groups.ep_size}
    for name, m in zip(master.names, master.params):
        g, shard = m.grad, shards.get(name)
        if shard is not None:
            group = groups.tp_group if shard.group == "tp" else groups.ep_group
            copies = size[shard.group] * shard.length // shard.full
            g = torch.cat(tpar.all_gather_stacked(g, group)[::copies].unbind(0), shard.dim)
        out[name] = g
    return out


def _sync_rank(max_norm: float):
    res = {}
    for tp, ep in LAYOUTS:
        groups = tpar.init_parallel(tp=tp, ep=ep)
        model = _tiny(groups=groups)
        batch = _batch()[groups.dp_rank::groups.dp_size]      # TP ranks share their batch
        lm_loss(model, batch).backward()
        master = MasterWeights(model)
        sync = GradSync(model, master, groups)
        master.grads_to_master()
        sync.average()
        norm = sync.clip(max_norm)
        res[(tp, ep)] = dict(norm=norm, grads=_full_grads(model, master, groups),
                             expert_dp=(groups.expert_dp_rank, groups.expert_dp_size))
    return res


@pytest.mark.timeout(240)
def test_grad_sync_and_clipping_over_shards_equal_one_process():
    """DP averaging (dense and expert replicas), the norm over TP / EP shards (the replicated KV
    head counted once) and the clipped gradients equal the one-process model's on the same
    global batch. Gradients are plain PyTorch math, not layout-invariant: compared within 1e-5."""
    model = _tiny()
    lm_loss(model, _batch()).backward()
    params = [p for _, p in model.named_parameters()]
    norm = float(torch.nn.utils.clip_grad_norm_(params, float("inf")))
    max_norm = norm / 2                                   # so every layout clips
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    want = {n: p.grad for n, p in model.named_parameters()}
    res = run_distributed(_sync_rank, 2, max_norm, timeout=200)
    for layout in LAYOUTS:
        tp, ep = layout
        want_edp = tpar.rank_layout(2, tp, ep).expert_dp_groups
        for rank in (0, 1):
            got = res[rank][layout]
            assert got["norm"] == pytest.approx(norm, rel=1e-5), layout
            edp = next(g for g in want_edp if rank in g)
            assert got["expert_dp"] == (edp.index(rank), len(edp)), layout
            for name, g in got["grads"].items():
                torch.testing.assert_close(g, want[name], rtol=1e-5, atol=1e-7,
                                           msg=lambda m: f"{layout} rank {rank} {name}: {m}")
        for name, g in res[0][layout]["grads"].items():   # the replicas agree bit for bit
            assert torch.equal(g, res[1][layout]["grads"][name]), (layout, name)


# -- resume ---------------------------------------------------------------------------------------
def _trainer(tmp_path):
    model = _tiny(torch.bfloat16)
    return Trainer(model, tpar.ParallelGroups.single(), lr=1e-2, warmup=2, total_steps=6,
                   ckpt_dir=str(tmp_path / "ckpt"), keep_last=2, meta={"run": "test"})


def _steps(trainer, start, stop):
    for step in range(start, stop):
        trainer.zero_grad()
        lm_loss(trainer.model, _batch(seed=step)).backward()
        trainer.step()
        torch.rand(1)                                   # the RNG advances too


def test_trainer_resume_is_bit_exact(tmp_path):
    straight = _trainer(tmp_path / "a")
    _steps(straight, 0, 4)
    first = _trainer(tmp_path / "b")
    _steps(first, 0, 2)
    first.save(2)
    _steps(first, 2, 3)                                 # lost work: the resume redoes it
    resumed = _trainer(tmp_path / "b")
    assert resumed.resume("latest")[0] == 2
    _steps(resumed, 2, 4)
    for a, b in zip(straight.master.params, resumed.master.params):
        assert torch.equal(a, b)
    for (n, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), n
    assert torch.equal(torch.get_rng_state(), torch.get_rng_state())
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        _trainer(tmp_path / "empty").resume("latest")


# -- metrics --------------------------------------------------------------------------------------
def test_metric_logger(tmp_path):
    log = MetricLogger(str(tmp_path), tensorboard=False)
    for step in (1, 2, 3):
        log.log({"step": step, "loss": 1.0 / step, "eval_loss": float("nan")}, echo=False)
    log.close()
    rows = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["eval_loss"] is None
    for line in open(tmp_path / "metrics.jsonl"):
        json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "lo')                      # a write cut short by a crash
    with pytest.raises(ValueError, match="metrics.jsonl:4: not a JSON object"):
        read_jsonl(str(tmp_path / "metrics.jsonl"))
    with pytest.warns(UserWarning, match="metrics.jsonl:4: dropped a torn last line"):
        log = MetricLogger(str(tmp_path), tensorboard=False, resume_step=2)
    log.close()
    assert [r["step"] for r in read_jsonl(str(tmp_path / "metrics.jsonl"))] == [1, 2]
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n[1, 2]\n{"step": 3}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2: not a JSON object"):
        MetricLogger(str(tmp_path), tensorboard=False, resume_step=3)
    MetricLogger(str(tmp_path / "off"), enabled=False).log({"step": 1})
    assert not (tmp_path / "off").exists()


# -- process groups -------------------------------------------------------------------------------
def _stall(args, groups):
    if groups.rank == 1:
        time.sleep(120)                                 # a rank that hangs without exiting
    start = time.monotonic()
    try:
        tpar.tree_all_reduce(torch.ones(4), groups.dp_group)
    except Exception as e:
        raise RuntimeError(f"failed after {time.monotonic() - start:.1f}s: {e}") from e


def _stall_rank(timeout_s: float):
    ap = argparse.ArgumentParser()
    add_launch_args(ap)
    return launch(ap.parse_args(["--dist-timeout", str(timeout_s)]), _stall)


@pytest.mark.timeout(120)
def test_dist_timeout_fails_a_stalled_peer_fast():
    """With --dist-timeout 3, rank 0 gives up on the stalled rank 1 after about 3 s (torch's
    default would hold it for 10 minutes, past this test's 60 s limit)."""
    with pytest.raises(DistributedError, match=r"rank 0 failed") as e:
        run_distributed(functools.partial(_stall_rank, 3.0), 2, init=False, timeout=60)
    seconds = float(re.findall(r"failed after ([0-9.]+)s: ", str(e.value))[-1])
    assert 2.5 < seconds < 30, str(e.value)[-2000:]


def test_init_parallel_timeout_is_checked():
    for bad in (0, -1.0, math.nan, "10"):
        with pytest.raises(ValueError, match="timeout must be a positive number"):
            tpar.init_parallel(timeout=bad)
