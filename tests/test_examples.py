"""The example scripts, run for a handful of steps on tiny sizes (loaded from examples/ by path).

pretrain: the loss falls; checkpoints are atomic and keep the last N; `--resume` continues bit for
bit as the uninterrupted run (fp32 and bf16 master weights), also past a torn metrics line; a crash
in the middle of a save leaves the previous checkpoint loadable; bad input is a clear error; the
HF export loads in transformers with the same logits. finetune: the loss is on the response tokens
only and a tokenizer.json is used when present. grpo: in invariant mode the training forward gives
the rollout's logprobs exactly (logdiff 0.0, every ratio 1); stock torch does not. Under several
ranks: DP replicas stay identical and log the global batch's loss; TP x EP gives the one-process
step-1 loss bit for bit. The rollout, the user-error and the demo tests are in
test_examples_cli.py.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import tonp_kernels as tk
from tonp_models import Qwen3MoeConfig, Qwen3MoeForCausalLM
from tonp_models.training import (ByteTokenizer, CheckpointError, CheckpointManager,
                                  ItemSampler, checkpoints, load_tokenizer, load_tokens, read_jsonl,
                                  read_meta, response_loss)
from tonp_parallel.launch import run_distributed

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def load_example(name: str):
    """examples/<name>.py as a module (the scripts import only installed packages)."""
    spec = importlib.util.spec_from_file_location(f"tonp_example_{name}",
                                                  os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pretrain, finetune, grpo = (load_example(n) for n in ("pretrain", "finetune", "grpo"))

# The tiny preset cut to one decoder layer, 4 windows of 33 tokens a step, one thread.
TINY = ["--batch-size", "4", "--seq-len", "32", "--warmup", "2", "--threads", "1",
        "--no-progress", "--eval-batches", "1", "--set", "num_hidden_layers=1"]


def run_pretrain(out, *extra):
    return pretrain.main(TINY + ["--out", str(out), *map(str, extra)])


def params_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), f"{k} differs"


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """One 6-step pretraining run shared by the tests that only read its outputs."""
    out = tmp_path_factory.mktemp("pretrain")
    return run_pretrain(out, "--steps", 6, "--eval-every", 3, "--save-every", 2, "--keep-last", 2,
                        "--lr", "1e-2")


def test_pretrain_loss_falls_and_writes_outputs(pretrained):
    losses = pretrained["losses"]
    assert sorted(losses) == list(range(1, 7))
    assert losses[6] < losses[1] - 0.3, losses
    assert set(pretrained["eval"]) == {3, 6}
    out = pretrained["out"]
    rows = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all({"loss", "lr", "grad_norm", "tokens_per_s"} <= set(r) for r in rows)
    assert os.path.getsize(os.path.join(out, "curves.png")) > 1000
    ckpts = sorted(os.listdir(os.path.join(out, "ckpt")))
    assert ckpts == ["step_00000004", "step_00000006"], "keep-last 2"


def test_pretrain_export_loads_in_transformers(pretrained):
    import transformers
    hf_dir = pretrained["hf"]
    ours = Qwen3MoeForCausalLM.from_pretrained(hf_dir)
    params_equal(ours, pretrained["model"])
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(hf_dir, attn_implementation="eager",
                                                          dtype=torch.float32).eval()
    ids = torch.tensor(list(b"the red fox runs to the hill. 3 plus 4 is 7."))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids[None]).logits[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_resume_equals_uninterrupted_run(tmp_path, dtype):
    common_args = ["--steps", 4, "--save-every", 2, "--eval-every", 2, "--dtype", dtype,
                   "--no-export"]
    straight = run_pretrain(tmp_path / "straight", *common_args)
    first = run_pretrain(tmp_path / "split", *common_args, "--stop-after", 2)
    assert first["step"] == 2 and sorted(first["losses"]) == [1, 2]
    # the crash also cut the metrics file in the middle of a line: resume drops it, with a word
    with open(tmp_path / "split" / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 5.1')
    with pytest.warns(UserWarning, match="metrics.jsonl:3: dropped a torn last line"):
        second = run_pretrain(tmp_path / "split", *common_args, "--resume")
    assert sorted(second["losses"]) == [3, 4]
    for step in range(1, 5):
        got = (first if step <= 2 else second)["losses"][step]
        assert got == straight["losses"][step], f"loss of step {step}"
    assert second["eval"][4] == straight["eval"][4]
    params_equal(second["model"], straight["model"])
    # the resumed run's metrics file continues the first one's
    rows = read_jsonl(os.path.join(tmp_path / "split", "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, 5))


def test_crash_in_the_middle_of_a_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    run_pretrain(tmp_path, "--steps", 4, "--save-every", 2, "--eval-every", 0, "--no-export",
                 "--stop-after", 2)
    real_write = checkpoints._write_file

    def torn_write(path, data):            # half the bytes reach the disk, then the crash
        real_write(path, data[:len(data) // 2])
        raise OSError("simulated crash during save")

    monkeypatch.setattr(checkpoints, "_write_file", torn_write)
    with pytest.raises(OSError, match="simulated crash"):
        run_pretrain(tmp_path, "--steps", 4, "--save-every", 2, "--eval-every", 0,
                     "--no-export", "--resume")
    monkeypatch.undo()
    mgr = CheckpointManager(str(tmp_path / "ckpt"))
    assert os.path.basename(mgr.latest()) == "step_00000002"
    assert any(n.startswith(".tmp-") for n in os.listdir(tmp_path / "ckpt"))   # the torn one
    res = run_pretrain(tmp_path, "--steps", 4, "--save-every", 2, "--eval-every", 0,
                       "--no-export", "--resume")
    assert sorted(res["losses"]) == [3, 4]
    assert not any(n.startswith(".tmp-") for n in os.listdir(tmp_path / "ckpt"))


def test_missing_data_and_checkpoints_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="data file not found: .*nope.txt"):
        run_pretrain(tmp_path, "--steps", 1, "--data", tmp_path / "nope.txt")
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        run_pretrain(tmp_path, "--steps", 1, "--resume")
    with pytest.raises(CheckpointError, match="no checkpoint directory at .*gone"):
        run_pretrain(tmp_path, "--steps", 1, "--resume", tmp_path / "gone")


def test_token_file_data(tmp_path):
    """A raw uint16 token file is memory-mapped and trains like text."""
    import numpy as np
    ids = np.frombuffer(open(os.path.join(EXAMPLES, "data", "corpus.txt"), "rb").read(20000),
                        dtype=np.uint8).astype(np.uint16)
    ids.tofile(tmp_path / "tokens.u16")
    toks = load_tokens(str(tmp_path / "tokens.u16"))
    assert isinstance(toks, np.memmap) and toks.dtype == np.uint16 and len(toks) == 20000
    res = run_pretrain(tmp_path, "--steps", 1, "--data", tmp_path / "tokens.u16", "--no-export",
                       "--eval-every", 0)
    assert torch.isfinite(torch.tensor(res["losses"][1]))


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("saved")
    run_pretrain(out, "--steps", 2, "--save-every", 2, "--eval-every", 0, "--no-export")
    return out


def copy_run(src, dst):
    shutil.copytree(src, dst)
    return dst, os.path.join(dst, "ckpt", "step_00000002")


def test_corrupted_checkpoint_is_a_clear_error(saved_run, tmp_path):
    out, ck = copy_run(saved_run, tmp_path / "run")
    path = os.path.join(ck, "rank00000.pt")
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match="rank00000.pt is corrupted"):
        run_pretrain(out, "--steps", 4, "--resume")
    os.remove(os.path.join(ck, "meta.json"))
    with pytest.raises(CheckpointError, match="no meta.json"):
        run_pretrain(out, "--steps", 4, "--resume", ck)


def test_mismatched_checkpoint_is_a_clear_error(saved_run, tmp_path):
    out, _ = copy_run(saved_run, tmp_path / "run")
    with pytest.raises(CheckpointError, match="dtype: saved 'fp32', now 'bf16'"):
        run_pretrain(out, "--steps", 4, "--resume", "--dtype", "bf16")
    cfg = Qwen3MoeConfig.preset("tiny", hidden_size=128).to_hf()
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="config differs in hidden_size"):
        run_pretrain(out, "--steps", 4, "--resume", "--config", cfg_path)


# -- finetune ---------------------------------------------------------------------------------------
def test_response_loss_ignores_the_prompt():
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig.preset("tiny"))
    prompts, responses = [[256, 1, 2, 3], [256, 9]], [[4, 5, 257], [7, 257]]
    loss = response_loss(model, prompts, responses)
    lp = model.token_logprobs([torch.tensor(p + r) for p, r in zip(prompts, responses)])
    want = -torch.cat([lp[0][3:], lp[1][1:]]).mean()
    assert torch.equal(loss, want)
    # changing the prompt's own continuation targets does not matter: only response rows count
    assert lp[0][3:].numel() == 3 and lp[1][1:].numel() == 2


def test_finetune_from_pretrained_export(pretrained, tmp_path):
    res = finetune.main(["--init", pretrained["hf"], "--out", str(tmp_path), "--steps", "4",
                         "--batch-size", "8", "--eval-every", "4", "--threads", "1",
                         "--no-progress", "--lr", "3e-3"])
    assert res["tokenizer"] == "ByteTokenizer"
    assert res["losses"][4] < res["losses"][1]
    assert os.path.isfile(os.path.join(tmp_path, "hf", "config.json"))
    assert os.path.isfile(os.path.join(tmp_path, "curves.png"))


def test_finetune_uses_tokenizer_json(pretrained, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = ["Q:", "A:", "what", "is", "plus", "the", "opposite", "of", "how", "written"]
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)},
             **{str(d): 20 + d for d in range(19)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    init = tmp_path / "init"
    shutil.copytree(pretrained["hf"], init)
    tok.save(str(init / "tokenizer.json"))
    res = finetune.main(["--init", str(init), "--out", str(tmp_path / "ft"), "--steps", "1",
                         "--batch-size", "4", "--eval-every", "0", "--threads", "1",
                         "--no-progress"])
    assert res["tokenizer"] == "HFTokenizer"
    assert os.path.isfile(tmp_path / "ft" / "hf" / "tokenizer.json")
    enc = load_tokenizer(str(init), res["model"].config)
    assert enc.encode("what is 3 plus 4") == [3, 4, 23, 5, 24]


def test_finetune_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not an HF checkpoint"):
        finetune.main(["--init", str(tmp_path), "--out", str(tmp_path / "o")])
    cases = {'{"prompt": "x"}\n': "bad.jsonl:1: expected a JSON object",
             '{"prompt": "x", "response": "y"}\n{"prompt": 1, "response": "y"}\n':
                 "bad.jsonl:2: expected a JSON object",
             '\n{"prompt": "x", "response": "y"\n': "bad.jsonl:2: not valid JSON"}
    for text, message in cases.items():
        (tmp_path / "bad.jsonl").write_text(text)
        with pytest.raises(ValueError, match=message):
            finetune.load_pairs(str(tmp_path / "bad.jsonl"), ByteTokenizer(), 64)


# -- grpo -------------------------------------------------------------------------------------------
GRPO = ["--steps", "2", "--sft-steps", "2", "--prompts", "2", "--group-size", "4",
        "--inner-steps", "2", "--threads", "1", "--no-progress", "--no-export",
        "--set", "num_hidden_layers=1"]


def test_grpo_rewards_and_advantages():
    tok = ByteTokenizer()
    assert grpo.reward(tok.encode("123") + [257], "123", tok) == 1.0
    assert grpo.reward(tok.encode("120") + [257, 5], "123", tok) == pytest.approx(2 / 3)
    assert grpo.reward(tok.encode("1234"), "123", tok) == pytest.approx(3 / 4)
    assert grpo.reward([257], "12", tok) == 0.0
    adv = grpo.group_advantages(torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.5, 0.5, 0.5, 0.5]]))
    assert torch.allclose(adv[0], torch.tensor([1.0, -1.0, 1.0, -1.0]), atol=1e-3)
    assert torch.equal(adv[1], torch.zeros(4))


def test_grpo_invariant_mode_is_exactly_on_policy(tmp_path):
    res = grpo.main(GRPO + ["--out", str(tmp_path)])
    rows = res["rows"]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["logdiff"] == 0.0
        assert r["ratio_is_one"] and r["ratio_min"] == 1.0 == r["ratio_max"]
        assert r["tokens_per_s"] > 0 and 0.0 <= r["reward"] <= 1.0
    logged = read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
    assert [r["phase"] for r in logged] == ["sft", "sft", "rl", "rl"]
    assert os.path.isfile(os.path.join(tmp_path, "curves.png"))
    assert read_meta(os.path.join(tmp_path, "ckpt", "step_00000002"))["script"] == "grpo"


def test_grpo_torch_mode_is_off_policy(tmp_path):
    res = grpo.main(GRPO + ["--out", str(tmp_path), "--mode", "torch"])
    assert max(r["logdiff"] for r in res["rows"]) > 0.0
    assert not all(r["ratio_is_one"] for r in res["rows"])
    assert tk.get_mode() == "invariant"          # the script restores the mode


# -- several ranks --------------------------------------------------------------------------------
def test_pretrain_data_parallel_under_torchrun(tmp_path):
    """Two DP ranks (gloo, torchrun): the fixed-order gradient average keeps the replicas
    identical, and the logged loss is the global batch's (the one-process run with both ranks'
    windows; not bitwise: the mean of two per-rank means rounds differently)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", "29517", os.path.join(EXAMPLES, "pretrain.py"), *TINY,
           "--steps", "2", "--save-every", "2", "--eval-every", "0", "--no-export",
           "--out", str(tmp_path), "--dist-timeout", "60"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ck = os.path.join(tmp_path, "ckpt", "step_00000002")
    states = [torch.load(os.path.join(ck, f"rank{r:05d}.pt"), weights_only=True)["model"]
              for r in (0, 1)]
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k
    meta = read_meta(ck)
    assert meta["layout"] == {"tp": 1, "ep": 1, "dp": 2, "pp": 1, "cp": 1, "sp": False,
                              "pp_layers": None} and meta["world_size"] == 2
    logged = read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))[0]["loss"]
    one = run_pretrain(tmp_path / "one", "--steps", 1, "--eval-every", 0, "--no-export",
                       "--batch-size", 8)["losses"][1]
    assert logged == pytest.approx(one, rel=1e-6, abs=0)


def _layouts_rank(out_dir: str, init_dir: str):
    """On each of 2 ranks: pretrain at TP 2 x EP 2, and finetune at DP 2."""
    rank = torch.distributed.get_rank()
    tiny = TINY + ["--steps", "2", "--eval-every", "0", "--no-export", "--save-every", "0"]
    tpep = pretrain.main(tiny + ["--tp", "2", "--ep", "2", "--out", f"{out_dir}/tpep"])
    ft = finetune.main(["--init", init_dir, "--out", f"{out_dir}/ft", "--steps", "1",
                        "--batch-size", "4", "--eval-every", "0", "--threads", "1",
                        "--no-progress", "--no-export", "--val-fraction", "0"])
    rows = read_jsonl(f"{out_dir}/tpep/metrics.jsonl") if rank == 0 else None
    return {"tpep": tpep["losses"], "rows": rows, "ft": ft["losses"]}


@pytest.mark.timeout(300)
def test_tp_ep_and_finetune_dp_runs(pretrained, tmp_path):
    """Pretrain at TP 2 x EP 2 gives the one-process step-1 loss bit for bit (the forward is
    layout-invariant) and its grad norm over the shards (not bitwise: gradients are plain
    PyTorch math); finetune at DP 2 logs the global batch's loss on every rank."""
    res = run_distributed(_layouts_rank, 2, str(tmp_path), pretrained["hf"], timeout=240)
    one = run_pretrain(tmp_path / "one", "--steps", 1, "--eval-every", 0, "--no-export")
    assert res[0]["tpep"][1] == one["losses"][1] == res[1]["tpep"][1]
    norm_one = read_jsonl(os.path.join(one["out"], "metrics.jsonl"))[0]["grad_norm"]
    assert res[0]["rows"][0]["grad_norm"] == pytest.approx(norm_one, rel=1e-5)
    # finetune's step-1 loss: the mean of the two ranks' losses (each scored here, same bits)
    model = Qwen3MoeForCausalLM.from_pretrained(pretrained["hf"])
    pairs = finetune.load_pairs(finetune.SFT, load_tokenizer(pretrained["hf"], model.config), 256)
    with torch.no_grad():
        per_rank = [response_loss(model, *zip(*ItemSampler(pairs, 4, 0, r, 2).next_batch()))
                    for r in (0, 1)]
    assert per_rank[0] != per_rank[1]
    assert res[0]["ft"][1] == res[1]["ft"][1] == float((per_rank[0] + per_rank[1]) / 2)
