"""The scripts at PP / CP / SP layouts, in one spawn of 2 gloo ranks:

* pretrain.py --pp 2 --micro-batches 2: every step's loss and grad norm equal the one-process
  run with the same micro-batches, bit for bit (PP gradients are PP 1's, the norm adds the
  stages' parts in the one-process order, AdamW is elementwise), so the runs stay identical;
* pretrain.py --cp 2 and --tp 2 --sp: the first step's loss bitwise (the forward is
  layout-invariant; later steps follow gradients that are correct, not bitwise);
* grpo.py --pp 2 --rollout-tp 2: trains at PP 2 and rolls out with a second model at TP 2 on
  the same ranks; every step logs logdiff 0.0 and every ratio 1, and the whole run (SFT
  losses, rollouts' rewards, RL losses) equals the one-process run bit for bit.
"""
from __future__ import annotations

import pytest

from dist_utils import run_distributed
from test_examples import TINY, grpo, pretrain

LAYERS = ["--set", "num_hidden_layers=2"]                 # after TINY's 1: two stages
STEPS = ["--steps", "2", "--eval-every", "0", "--no-export", "--save-every", "0",
         "--micro-batches", "2"]
GRPO = ["--steps", "2", "--sft-steps", "2", "--prompts", "2", "--group-size", "2",
        "--threads", "1", "--no-progress", "--no-export", "--micro-batches", "2",
        "--set", "num_hidden_layers=2"]
ROW_KEYS = ("reward", "solved", "loss", "sft_loss", "logdiff", "ratio_is_one", "sample")


def _rows(res):
    return [{k: r.get(k) for k in ROW_KEYS} for r in res["rows"]]


def _scripts_rank(out: str):
    losses = {}
    for name, flags in [("pp2", ["--pp", "2"]), ("cp2", ["--cp", "2"]),
                        ("tp2sp", ["--tp", "2", "--sp"])]:
        res = pretrain.main(TINY + LAYERS + STEPS + flags + ["--out", f"{out}/{name}"])
        losses[name] = res["losses"]
    g = grpo.main(GRPO + ["--pp", "2", "--rollout-tp", "2", "--out", f"{out}/grpo"])
    from tonp_models.training import read_jsonl
    norms = [r["grad_norm"] for r in read_jsonl(f"{out}/pp2/metrics.jsonl")]
    return dict(losses=losses, norms=norms, grpo=_rows(g))


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp_scripts")
    return run_distributed(_scripts_rank, 2, str(out), timeout=600), out


@pytest.mark.timeout(600)
def test_pretrain_at_pp2_is_the_one_process_run(spawned):
    from tonp_models.training import read_jsonl
    outs, tmp = spawned
    one = pretrain.main(TINY + LAYERS + STEPS + ["--out", str(tmp / "one")])
    norms = [r["grad_norm"] for r in read_jsonl(str(tmp / "one" / "metrics.jsonl"))]
    for o in outs:
        assert o["losses"]["pp2"] == one["losses"], (o["losses"]["pp2"], one["losses"])
        assert o["norms"] == norms
        for name in ("cp2", "tp2sp"):
            assert o["losses"][name][1] == one["losses"][1], (name, o["losses"][name])
            assert o["losses"][name][2] == pytest.approx(one["losses"][2], rel=1e-5)


@pytest.mark.timeout(600)
def test_grpo_trains_at_pp2_and_rolls_out_at_tp2(spawned):
    outs, tmp = spawned
    one = _rows(grpo.main(GRPO + ["--out", str(tmp / "grpo_one")]))
    for o in outs:
        rl = [r for r in o["grpo"] if r["logdiff"] is not None]
        assert len(rl) == 2 and all(r["logdiff"] == 0.0 and r["ratio_is_one"] for r in rl)
        assert o["grpo"] == one
