"""Pipeline parallelism gives the one-process model's bits (CONTRACT.md 4).

One spawn of 4 gloo ranks walks PP in {1, 2, 4}, an uneven split, PP 2 x TP 2 and PP 2 x EP 2
(tests/layout_walk.py): token_logprobs, logits, greedy and sampled generate (micro-batches in
flight between stages), a 1F1B training step's loss and logprobs: torch.equal to the
one-process model; the synced gradients bitwise equal to PP 1's where the order allows (PP
alone: every stage runs PP 1's ops on the same rows, and each parameter's gradient accumulates
over the micro-batches in the same order), within 2e-6 + 1e-5 |g| with TP / EP (their backward
sums in another order); a rollout at one layout scored at the next: logdiff 0; the twins: stock
torch changes the bits at every one of these layouts (the pipeline's micro-batches give
F.linear another M).
A checkpoint saved at PP 4 loads at PP 1 and at TP 2; a stage that raises makes every rank of
its pipeline raise within seconds (the collective timeout is 120 s); bad splits are refused.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

import layout_walk as lw
from dist_utils import run_distributed

WORLD = 4
LAYOUTS = [dict(), dict(pp=2), dict(pp=4), dict(pp=2, pp_layers=(3, 1)), dict(pp=2, tp=2),
           dict(pp=2, ep=2)]
EXACT = {lw.key(x) for x in LAYOUTS[:4]}


def _pipeline_rank(ckpt: str):
    import torch.distributed as dist

    import tonp_parallel as tpar
    from tonp_models import Qwen3MoeForCausalLM
    walked = lw.walk(LAYOUTS)
    g = tpar.init_parallel(pp=4, timeout=120)                    # save at PP 4 ...
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(lw.config(), groups=g).save_pretrained(ckpt)
    dist.barrier()
    tp2 = Qwen3MoeForCausalLM.from_pretrained(ckpt, groups=tpar.init_parallel(tp=2))  # TP 2
    loaded = {n: p.detach().clone() for n, p in tp2.named_parameters()}
    errors = {}
    for name, make in [
            ("world", lambda: tpar.init_parallel(pp=3)),
            ("split", lambda: Qwen3MoeForCausalLM(
                lw.config(), groups=tpar.init_parallel(pp=2, pp_layers=(2, 1)))),
            ("layers", lambda: Qwen3MoeForCausalLM(
                lw.config(num_hidden_layers=2, mlp_only_layers=[]),
                groups=tpar.init_parallel(pp=4))),
            ("tied", lambda: Qwen3MoeForCausalLM(lw.config(tie_word_embeddings=True),
                                                 groups=tpar.init_parallel(pp=2))),
            ("grad", lambda: Qwen3MoeForCausalLM(lw.config(), groups=tpar.init_parallel(pp=2))
             .token_logprobs(lw.seqs()))]:
        try:
            make()
            errors[name] = "no error"
        except (ValueError, TypeError) as e:
            errors[name] = str(e)
    return dict(walk=walked, loaded=loaded, shards=tp2.parameter_shards(), errors=errors)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("pp_ckpt") / "pp4"
    return run_distributed(_pipeline_rank, WORLD, str(ckpt), timeout=600), ckpt


def _reference():
    from tonp_models import Qwen3MoeForCausalLM
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(lw.config())


@pytest.mark.timeout(600)
def test_pipeline_layouts_equal_the_one_process_model(spawned):
    """Bits, rescoring, gradients (bitwise at PP alone) and the stock-torch twins."""
    lw.check_layouts([o["walk"] for o in spawned[0]], exact=EXACT)


@pytest.mark.timeout(600)
def test_each_stage_holds_only_its_layers(spawned):
    walked = spawned[0][0]["walk"]
    stages = {}
    for r in (o["walk"][2] for o in spawned[0]):          # PP 4: one layer a stage
        names = set(r["grads"])
        layers = {int(n.split(".")[1]) for n in names if n.startswith("layers.")}
        stages[r["rank"]] = layers
        assert ("embed_tokens.weight" in names) == (r["rank"] == 0)
        assert ("lm_head.weight" in names) == (r["rank"] == 3)
    assert stages == {0: {0}, 1: {1}, 2: {2}, 3: {3}}
    uneven = {o["walk"][3]["rank"]: {n.split(".")[1] for n in o["walk"][3]["grads"]
                                     if n.startswith("layers.")} for o in spawned[0]}
    assert uneven[0] == {"0", "1", "2"} and uneven[2] == {"3"}, uneven
    assert walked


@pytest.mark.timeout(600)
def test_checkpoint_saved_at_pp4_loads_at_pp1_and_tp2(spawned):
    from tonp_models import Qwen3MoeForCausalLM
    outs, ckpt = spawned
    ref = dict(_reference().named_parameters())
    one = Qwen3MoeForCausalLM.from_pretrained(ckpt)                    # PP 1, one process
    for n, p in one.named_parameters():
        assert torch.equal(p, ref[n]), n
    for o in outs:                                                     # TP 2, each rank's shard
        for n, p in o["loaded"].items():
            want = o["shards"][n].take(ref[n]) if n in o["shards"] else ref[n]
            assert torch.equal(p, want), n


@pytest.mark.timeout(600)
def test_bad_pipeline_layouts_are_refused(spawned):
    errors = spawned[0][0]["errors"]
    assert "not divisible by tp x pp = 1 x 3" in errors["world"]
    assert "pp_layers=[2, 1] sums to 3, not to the 4 layers" in errors["split"]
    assert "pp=4 exceeds the 2 layers" in errors["layers"]
    assert "tie_word_embeddings=True with pp=2" in errors["tied"]
    assert "autograd does not cross stages" in errors["grad"]
    assert "forward_backward" in errors["grad"]


def test_stage_layers_and_micro_batches():
    from tonp_parallel.layout import stage_layers
    from tonp_parallel.pipeline import micro_batch_bounds
    assert stage_layers(48, 4, (13, 12, 12, 11)) == [range(0, 13), range(13, 25), range(25, 37),
                                                     range(37, 48)]
    assert stage_layers(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    for bad, why in [((13, 12, 12), "one per stage"), ((13, 12, 12, 10), "sums to 47"),
                     ((13, 0, 12, 23), "positive ints")]:
        with pytest.raises(ValueError, match=why):
            stage_layers(48, 4, bad)
    assert micro_batch_bounds([5, 5, 5, 5], 2) == [range(0, 2), range(2, 4)]
    assert micro_batch_bounds([1, 1, 1, 10], 3) == [range(0, 2), range(2, 3), range(3, 4)]
    with pytest.raises(ValueError, match="non-empty"):
        micro_batch_bounds([1, 2], 3)


def test_rank_layout_is_megatrons():
    """tp-cp-ep-dp-pp: every group equals megatron-core's RankGenerator's."""
    from megatron.core import parallel_state as ps
    import tonp_parallel as tpar
    for W, tp, ep, pp, cp in [(8, 2, 2, 2, 1), (8, 1, 2, 2, 2), (16, 2, 4, 2, 2), (8, 2, 1, 2, 2),
                              (16, 1, 4, 4, 1)]:
        mine = tpar.rank_layout(W, tp, ep, pp=pp, cp=cp)
        dense = ps.RankGenerator(tp=tp, ep=1, dp=W // (tp * cp * pp), pp=pp, cp=cp,
                                 order="tp-cp-ep-dp-pp")
        expert = ps.RankGenerator(tp=1, ep=ep, dp=W // (ep * pp), pp=pp, cp=1,
                                  order="tp-cp-ep-dp-pp")
        for gen, kind, ours in [(dense, "tp", mine.tp_groups), (dense, "dp", mine.dp_groups),
                                (dense, "pp", mine.pp_groups), (dense, "cp", mine.cp_groups),
                                (dense, "dp-cp", mine.dp_cp_groups),
                                (expert, "ep", mine.ep_groups),
                                (expert, "dp", mine.expert_dp_groups)]:
            assert [tuple(r) for r in gen.get_ranks(kind)] == ours, (W, tp, ep, pp, cp, kind)


# -- a stage that raises -----------------------------------------------------------------------
def _failing_rank():
    """Two pipelines of 2 stages (DP 2). Pipeline {0, 2}: stage 1's MLP raises during a 1F1B
    step; pipeline {1, 3}: stage 0's during generate. Each rank returns what it raised and
    how long it took."""
    import tonp_parallel as tpar
    from tonp_models import Qwen3MoeForCausalLM, generate
    g = tpar.init_parallel(pp=2, timeout=120)
    model = Qwen3MoeForCausalLM(lw.config(), groups=g)
    bad_stage = 1 if g.dp_rank == 0 else 0

    def boom(*args, **kwargs):
        raise RuntimeError(f"boom on stage {g.pp_rank}")
    if g.pp_rank == bad_stage:
        model.layers[model.stage.start].mlp.forward = boom
    t0 = time.monotonic()
    try:
        if g.dp_rank == 0:
            model.forward_backward(lw.seqs(), lambda lp, i: -torch.cat(lp).sum(), micro_batches=3)
        else:
            generate(model, lw.PROMPTS, 3)
        return "no error", time.monotonic() - t0
    except Exception as e:  # noqa: BLE001 -- the outcome under test
        return f"{type(e).__name__}: {e}", time.monotonic() - t0


@pytest.mark.timeout(300)
def test_a_stage_that_raises_fails_every_rank_fast():
    outs = run_distributed(_failing_rank, WORLD, timeout=200,
                           env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    for rank, (msg, seconds) in enumerate(outs):
        stage, failing = rank // 2, 1 if rank % 2 == 0 else 0
        if stage == failing:
            assert msg == f"RuntimeError: boom on stage {stage}", (rank, msg)
        else:
            assert msg.startswith(f"StageFailed: tonp_parallel.pipeline: stage {failing}"), \
                (rank, msg)
        assert seconds < 60, f"rank {rank} took {seconds:.0f} s to fail (timeout 120 s)"
