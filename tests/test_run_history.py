"""A run never destroys its own history: a fresh start in an --out that holds a run is refused
unless --overwrite (pretrain, finetune, grpo alike); a resume from an older checkpoint of the same
--out, or from another run's into it, is refused; a resume with other hyper-parameters than the
checkpoint's is refused naming the flag, and --steps is applied (bit for bit the run started with
those --steps); metrics.jsonl is rewritten atomically (a kill -9 in the middle leaves it whole);
CheckpointManager refuses caller keys it writes itself and leaves no `.old-step_*` behind."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import tonp_parallel as tpar
from tonp_models.training import (CheckpointError, CheckpointManager, MetricLogger,
                                  prepare_out_dir, read_jsonl, read_meta)
from tonp_parallel.launch import run_distributed
from tonp_models.training.cli import run_script

from test_examples import EXAMPLES, TINY, finetune, grpo, params_equal, pretrain, run_pretrain

QUIET = ["--eval-every", "0", "--no-export"]


def snapshot(out):
    """Every file under `out` with its bytes (what a refused run must leave as it was)."""
    files = {}
    for root, _, names in os.walk(out):
        for n in names:
            p = os.path.join(root, n)
            files[os.path.relpath(p, out)] = open(p, "rb").read()
    return files


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """A run of --steps 4 stopped after step 3: checkpoints step_1..3, metrics rows 1..3."""
    out = tmp_path_factory.mktemp("first") / "run"
    res = run_pretrain(out, "--steps", 4, "--save-every", 1, "--keep-last", 3, "--stop-after", 3,
                       *QUIET)
    return out, res["losses"]


def copy(first, tmp_path):
    shutil.copytree(first[0], tmp_path / "run")
    return tmp_path / "run"


def ckpts(out):
    return sorted(os.listdir(os.path.join(out, "ckpt")))


def one_line_error(capsys, prog, rc):
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith(f"{prog}: error: ") and err.count("\n") == 1, err
    return err


# -- a fresh start over a run ---------------------------------------------------------------------
def test_a_fresh_start_over_a_run_is_refused(first, tmp_path, capsys):
    out = copy(first, tmp_path)
    before = snapshot(out)
    rc = run_script(pretrain.main, "pretrain.py", TINY + ["--out", str(out), "--steps", "2",
                                                          *QUIET])
    err = one_line_error(capsys, "pretrain.py", rc)
    assert f"--out {out} already holds a run (3 checkpoints up to step_00000003, metrics.jsonl)" \
        in err and "--resume" in err and "--overwrite" in err, err
    init = tmp_path / "init"                    # finetune checks --init has a config.json first
    init.mkdir()
    (init / "config.json").write_text("{}")
    rc = run_script(finetune.main, "finetune.py", ["--init", str(init), "--out", str(out)])
    assert "already holds a run" in one_line_error(capsys, "finetune.py", rc)
    rc = run_script(grpo.main, "grpo.py", ["--out", str(out), "--no-progress"])
    err = one_line_error(capsys, "grpo.py", rc)
    assert "already holds a run" in err and "--overwrite" in err and "--resume" not in err, err
    assert snapshot(out) == before               # nothing truncated, pruned or added
    # metrics alone (a run that died before its first checkpoint) are a history too
    shutil.rmtree(out / "ckpt")
    rc = run_script(pretrain.main, "pretrain.py", TINY + ["--out", str(out), "--steps", "1",
                                                          *QUIET])
    assert "already holds a run (metrics.jsonl)" in one_line_error(capsys, "pretrain.py", rc)


def test_overwrite_starts_afresh_and_resume_continues_the_new_run(first, tmp_path, capsys):
    out = copy(first, tmp_path)
    (out / "notes.txt").write_text("mine")      # not the run's: --overwrite leaves it
    new = run_pretrain(out, "--steps", 2, "--save-every", 2, "--overwrite", *QUIET)
    said = capsys.readouterr().out
    assert "--overwrite: deleted the previous run's ckpt/, metrics.jsonl" in said, said
    assert ckpts(out) == ["step_00000002"] and (out / "notes.txt").read_text() == "mine"
    assert [r["step"] for r in read_jsonl(str(out / "metrics.jsonl"))] == [1, 2]
    assert new["losses"] == {s: first[1][s] for s in (1, 2)}   # as in a fresh directory
    more = run_pretrain(out, "--steps", 3, "--resume", *QUIET)
    assert more["start"] == 2 and sorted(more["losses"]) == [3]      # the new run's step 2
    assert [r["step"] for r in read_jsonl(str(out / "metrics.jsonl"))] == [1, 2, 3]


def test_grpo_overwrite_keeps_the_new_runs_checkpoint(tmp_path):
    """grpo keeps one checkpoint: over an old run of more steps it used to prune its own."""
    flags = ["--sft-steps", "1", "--prompts", "1", "--group-size", "2", "--inner-steps", "1",
             "--threads", "1", "--no-progress", "--no-export", "--set", "num_hidden_layers=1",
             "--out", str(tmp_path)]
    grpo.main(flags + ["--steps", "2"])
    with pytest.raises(ValueError, match="already holds a run"):
        grpo.main(flags + ["--steps", "1"])
    grpo.main(flags + ["--steps", "1", "--overwrite"])
    assert ckpts(tmp_path) == ["step_00000001"]
    assert [r["phase"] for r in read_jsonl(str(tmp_path / "metrics.jsonl"))] == ["sft", "rl"]


def test_resumes_that_would_mix_two_histories_are_refused(first, tmp_path):
    out = copy(first, tmp_path)
    before = snapshot(out)
    older = str(out / "ckpt" / "step_00000001")
    with pytest.raises(ValueError, match=r"step_00000001 is not the newest checkpoint in .*"
                                         r"\(step_00000003 is\)"):
        run_pretrain(out, "--steps", 4, "--resume", older, *QUIET)
    with pytest.raises(ValueError, match="--overwrite would delete the checkpoints in"):
        run_pretrain(out, "--steps", 4, "--resume", "--overwrite", *QUIET)
    other = copy(first, tmp_path / "other")     # another run's checkpoint, into this --out
    with pytest.raises(ValueError, match=r"already holds a run .*; --resume .* is another "
                                         r"run's checkpoint: pass --overwrite"):
        run_pretrain(out, "--steps", 4, "--resume", other / "ckpt" / "step_00000003", *QUIET)
    assert snapshot(out) == before
    fork = run_pretrain(tmp_path / "fork", "--steps", 4, "--resume",
                        other / "ckpt" / "step_00000003", *QUIET)   # a fresh --out: allowed
    assert fork["start"] == 3 and sorted(fork["losses"]) == [4]


def _two_ranks(out: str):
    groups = tpar.init_parallel()
    try:
        prepare_out_dir(out, resume=None, overwrite=False, groups=groups)
        refused = None
    except ValueError as e:
        refused = str(e)
    prepare_out_dir(out, resume=None, overwrite=True, groups=groups)
    return refused, sorted(os.listdir(out))        # after the barrier: rank 0 has deleted


def test_every_rank_gets_the_same_answer(first, tmp_path):
    """Rank 0 decides and every rank raises the same error; --overwrite deletes before any rank
    goes on."""
    out = copy(first, tmp_path)
    res = run_distributed(_two_ranks, 2, str(out), timeout=120)
    assert res[0] == res[1] and "already holds a run" in res[0][0], res
    assert res[0][1] == [], res


# -- a resume's hyper-parameters ------------------------------------------------------------------
def test_resume_with_other_hyperparameters_is_refused(first, tmp_path):
    out = copy(first, tmp_path)
    corpus = shutil.copy(os.path.join(EXAMPLES, "data", "corpus.txt"), tmp_path / "corpus.txt")
    for flag, value, saved in [("--lr", "0.01", "0.005"), ("--batch-size", "2", "4"),
                               ("--seed", "1", "0"), ("--warmup", "3", "2"),
                               ("--weight-decay", "0", "0.1"), ("--seq-len", "16", "32"),
                               ("--micro-batches", "2", "1"), ("--mode", "torch", "'invariant'"),
                               ("--data", str(corpus), "'/")]:
        with pytest.raises(CheckpointError, match=rf"flags differs in {flag}: saved {saved}"):
            run_pretrain(out, "--steps", 4, "--resume", flag, value, *QUIET)
    assert read_meta(str(out / "ckpt" / "step_00000003"))["flags"]["--lr"] == 0.005


def test_resume_with_more_steps_applies_the_new_schedule(first, tmp_path, capsys):
    """--steps is applied: from step 3 of a 4-step run, --steps 6 gives the 6-step run bit for
    bit (the lr of step 4 comes from the new schedule, not the one the checkpoint saved)."""
    out = copy(first, tmp_path)
    straight = run_pretrain(tmp_path / "straight", "--steps", 6, *QUIET)
    capsys.readouterr()
    res = run_pretrain(out, "--steps", 6, "--resume", *QUIET)
    assert {s: first[1][s] for s in (1, 2, 3)} == {s: straight["losses"][s] for s in (1, 2, 3)}
    assert res["losses"] == {s: straight["losses"][s] for s in (4, 5, 6)}
    params_equal(res["model"], straight["model"])
    assert "at step 3; steps=6 applied: the lr schedule now ends at step 6 (the checkpoint's " \
           "run: 4)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="steps=2 is below the step of the checkpoint"):
        run_pretrain(out, "--steps", 2, "--resume", *QUIET)


# -- the library pieces ---------------------------------------------------------------------------
def test_checkpoint_meta_cannot_overwrite_the_managers_keys(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="meta keys 'files', 'step' are reserved"):
        mgr.save(1, {"x": torch.zeros(1)}, {"step": 7, "files": {}, "run": "a"})
    assert not (tmp_path / "ckpt").exists()                    # nothing written
    mgr.save(1, {"x": torch.zeros(1)}, {"run": "a"})
    assert read_meta(mgr.latest())["step"] == 1


def test_resaving_a_step_leaves_no_old_directory(tmp_path, monkeypatch):
    mgr = CheckpointManager(str(tmp_path), keep_last=2)
    mgr.save(1, {"x": torch.zeros(1)}, {"v": 1})
    mgr.save(1, {"x": torch.ones(1)}, {"v": 2})
    assert sorted(os.listdir(tmp_path)) == ["step_00000001"]
    assert torch.equal(mgr.load(mgr.latest())["x"], torch.ones(1))
    # a crash between the two renames of a re-save: the old checkpoint still counts, and the
    # next save puts it back in place
    real_rename = os.rename

    def crash_after_first(src, dst):
        real_rename(src, dst)
        if os.path.basename(dst).startswith(".old-"):
            raise OSError("simulated crash between the renames")

    monkeypatch.setattr(os, "rename", crash_after_first)
    with pytest.raises(OSError, match="simulated crash"):
        mgr.save(1, {"x": torch.full((1,), 3.0)}, {"v": 3})
    monkeypatch.undo()
    assert [os.path.basename(p) for p in mgr.complete()] == [".old-step_00000001"]
    assert read_meta(mgr.latest())["v"] == 2
    mgr.save(2, {"x": torch.zeros(1)}, {"v": 4})
    assert sorted(os.listdir(tmp_path)) == ["step_00000001", "step_00000002"]
    assert read_meta(mgr.complete()[0])["v"] == 2


KILLED_REWRITE = textwrap.dedent("""
    import os, signal, sys
    from tonp_models.training import metrics
    real, n = metrics._dumps, [0]
    def dying(row):                       # kill -9 in the middle of the rewrite
        n[0] += 1
        if n[0] == 1000:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(row)
    metrics._dumps = dying
    metrics.MetricLogger(sys.argv[1], tensorboard=False, resume_step=1500)
""")


def test_metrics_rewrite_killed_midway_keeps_the_file(tmp_path):
    log = MetricLogger(str(tmp_path), tensorboard=False)
    for step in range(1, 2001):
        log.log({"step": step, "loss": 1.0 / step}, echo=False)
    log.close()
    before = (tmp_path / "metrics.jsonl").read_bytes()
    proc = subprocess.run([sys.executable, "-c", KILLED_REWRITE, str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    log = MetricLogger(str(tmp_path), tensorboard=False, resume_step=1500)   # the rerun
    log.log({"step": 1501, "loss": 0.5}, echo=False)
    log.close()
    assert [r["step"] for r in read_jsonl(str(tmp_path / "metrics.jsonl"))] == \
        list(range(1, 1502))
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]     # no temporary file left
