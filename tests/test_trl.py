"""TRL's own GRPOTrainer loop on tonp (tonp_models.integrations.trl), judged by TRL's own
metrics in `trainer.state.log_history`:
- with tonp as scorer and generator (in process, or a tonp server started here on a free
  loopback port, weights pushed each generation), `sampling/sampling_logp_difference/max` is
  exactly 0.0 and `sampling/importance_sampling_ratio/{min,max}` exactly 1.0 at every step that
  generated, for num_iterations 1 and 2 (and beta > 0), and the weights change;
- the twin: the same run with stock torch ops (`tonp_kernels.use("torch")`) logs a non-zero
  difference (in process: both sides stock; server: the scorer stock, the server tonp);
- the server run is bit for bit the in-process run (the same losses), with one weight version
  a generation; `accelerate launch` over 2 processes (DDP, gloo) keeps the promise, each
  process drawing its own samples;
- the padded batch TRL hands the scorer gives the packed `token_logprobs` bits at any padding;
- options tonp cannot honour raise at construction, naming the option.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from serve_utils import REPO, ServerProcess
from trl_utils import SAMPLING, make_trainer, sampling_rows, tiny_policy

import tonp_kernels as tk
from tonp_models.integrations.tokenizer import byte_tokenizer
from tonp_models.integrations.trl import TonpGRPOTrainer, tonp_grpo_config
from tonp_models.serve import RolloutClient

STEPS = 3
_RUNS = {}


def _run(tmp_path_factory, generator=None, mode="invariant", weights_dir=None, **config):
    """(log_history, whether the weights changed, weight versions the server went through) of a
    3-step run, cached per settings."""
    key = (generator is not None, weights_dir is not None, mode, tuple(sorted(config.items())))
    if key not in _RUNS:
        model, w0 = tiny_policy()
        trainer = make_trainer(model, tmp_path_factory.mktemp("trl"), generator=generator,
                               weights_dir=weights_dir, steps=STEPS, **config)
        before = RolloutClient(generator).wait_ready()["weight_version"] if generator else None
        with tk.use(mode):
            trainer.train()
        changed = any(not torch.equal(w0[k], v) for k, v in model.named_parameters())
        after = trainer.tonp_generator.weight_version
        _RUNS[key] = (trainer.state.log_history, changed,
                      None if generator is None else after - before)
    return _RUNS[key]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A tonp server holding the tiny policy's initial weights (each run pushes its own); disk
    updates may come from inside its checkpoint directory."""
    ckpt = tmp_path_factory.mktemp("trl_ckpt")
    tiny_policy()[0].save_pretrained(ckpt)
    byte_tokenizer().save_pretrained(ckpt)
    with ServerProcess(["--hf", str(ckpt)]) as srv:
        srv.ckpt = ckpt
        yield srv


def _assert_on_policy(log, changed, num_iterations):
    rows = sampling_rows(log)
    assert len(rows) == -(-STEPS // num_iterations), log       # one row per generation
    for r in rows:
        assert r[SAMPLING[0]] == 0.0, r
        assert r[SAMPLING[1]] == 1.0 and r[SAMPLING[2]] == 1.0, r
    assert changed


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_in_process_is_on_policy(tmp_path_factory, num_iterations):
    log, changed, _ = _run(tmp_path_factory, num_iterations=num_iterations)
    _assert_on_policy(log, changed, num_iterations)


@pytest.mark.parametrize("num_iterations, transfer", [(1, "distributed"), (2, "distributed"),
                                                      (1, "disk")])
def test_server_is_on_policy_and_equals_in_process(tmp_path_factory, server, num_iterations,
                                                   transfer):
    """distributed: SGLang's /update_weights_from_distributed (gloo) from the trainer's
    tensors; disk: /update_weights from a checkpoint written inside the server's directory."""
    log, changed, pushes = _run(tmp_path_factory, generator=server.url,
                                weights_dir=str(server.ckpt / "push") if transfer == "disk"
                                else None, num_iterations=num_iterations)
    _assert_on_policy(log, changed, num_iterations)
    local, _, _ = _run(tmp_path_factory, num_iterations=num_iterations)
    assert [r.get("loss") for r in log] == [r.get("loss") for r in local]
    assert [r.get("reward") for r in log] == [r.get("reward") for r in local]
    # each generation pushed the weights once (the generator checked that every result
    # carries the version its push returned)
    assert pushes == len(sampling_rows(log))


def test_reference_model_kl_stays_on_policy(tmp_path_factory):
    log, changed, _ = _run(tmp_path_factory, beta=0.04)
    _assert_on_policy(log, changed, 1)
    kl = [r["kl"] for r in sampling_rows(log)]
    assert kl[0] == 0.0 and kl[-1] > 0.0          # the policy moves away from its frozen copy


def test_ragged_completions_top_k_top_p_temperature_stay_on_policy(tmp_path):
    """Completions of many lengths (one token in 8 ends a request), truncated ones masked out,
    top-k / top-p sampling at T = 0.7: the right-padded batch still scores exactly."""
    from tonp_models.integrations.trl import TonpPolicy
    model, w0 = tiny_policy()
    policy = TonpPolicy(model)
    policy.generation_config.eos_token_id = list(range(3, 320, 8))
    trainer = make_trainer(policy, tmp_path, steps=STEPS, temperature=0.7, top_k=40, top_p=0.9,
                           mask_truncated_completions=True, max_completion_length=10)
    trainer.train()
    log = trainer.state.log_history
    _assert_on_policy(log, any(not torch.equal(w0[k], v) for k, v in model.named_parameters()),
                      1)
    lengths = [(r["completions/min_length"], r["completions/max_length"]) for r in log
               if "completions/min_length" in r]
    assert any(lo < hi for lo, hi in lengths), lengths


def test_server_refuses_results_of_other_weights(server):
    """A push by someone else between sync and generate: the generator raises."""
    from tonp_models.integrations.rollout import ServerGenerator
    model, _ = tiny_policy()
    gen = ServerGenerator(server.url)
    try:
        gen.sync(model, 0)
        RolloutClient(server.url).update_weights(str(server.ckpt))       # version + 1
        with pytest.raises(RuntimeError, match="weight version"):
            gen.generate([[52, 62]], [0], max_new_tokens=2, temperature=1.0,
                         eos_token_ids=[257])
    finally:
        gen.close()


def test_stock_kernels_twin_logs_a_difference(tmp_path_factory):
    log, _, _ = _run(tmp_path_factory, mode="torch")
    assert max(r[SAMPLING[0]] for r in sampling_rows(log)) > 0.0


def test_stock_scorer_against_tonp_server_logs_a_difference(tmp_path_factory, server):
    log, _, _ = _run(tmp_path_factory, generator=server.url, mode="torch")
    assert max(r[SAMPLING[0]] for r in sampling_rows(log)) > 0.0


def test_scorer_is_packed_token_logprobs_at_any_padding(tmp_path):
    """TRL's [B, P + C] layout at two paddings and micro-batch sizes -> the completion rows of
    `token_logprobs` of the unpadded sequences, bit for bit (0 past each completion)."""
    model, _ = tiny_policy()
    trainer = make_trainer(model, tmp_path, steps=1)
    seqs = [torch.tensor([52, 48, 55, 62, 1, 2, 3]), torch.tensor([51, 62, 9]),
            torch.tensor([50, 48, 62, 7, 8])]
    prompt_lens = [4, 2, 3]
    want = model.token_logprobs(seqs)

    def padded(extra):   # TRL's layout: prompts left-padded, completions right-padded
        P, C = max(prompt_lens) + extra, max(len(s) - p for s, p in zip(seqs, prompt_lens)) + extra
        ids = torch.full((len(seqs), P + C), 256)
        mask = torch.zeros_like(ids)
        for i, (s, p) in enumerate(zip(seqs, prompt_lens)):
            ids[i, P - p:P + len(s) - p], mask[i, P - p:P + len(s) - p] = s, 1
        return ids, mask, C
    for extra, micro_batch in ((0, None), (3, 2)):
        ids, mask, C = padded(extra)
        lp, ent, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, C, batch_size=micro_batch, compute_entropy=True)
        for i, (w, p) in enumerate(zip(want, prompt_lens)):
            n = len(seqs[i]) - p
            assert torch.equal(lp[i, :n], w[p - 1:]) and torch.equal(lp[i, n:], torch.zeros(C - n))
            assert torch.isfinite(ent[i, :n]).all() and (ent[i, :n] > 0).all()


@pytest.mark.parametrize("option, value", [
    ("repetition_penalty", 1.1), ("min_p", 0.1), ("generation_kwargs", {"num_beams": 2}),
    ("gradient_checkpointing", True), ("bf16", True), ("cast_lm_head_to_fp32", True),
    ("use_liger_kernel", True), ("entropy_coef", 0.01), ("vllm_mode", "server"),
    ("vllm_structured_outputs_regex", "[0-9]+"), ("router_aux_loss_coef", 0.01),
    ("sync_ref_model", True), ("temperature", 0.0),
])
def test_unsupported_options_raise_naming_the_option(tmp_path, option, value):
    model, _ = tiny_policy()
    with pytest.raises(ValueError, match=option):
        make_trainer(model, tmp_path, **{option: value})


def test_unsupported_trainer_arguments_raise(tmp_path):
    model, _ = tiny_policy()
    args = tonp_grpo_config(output_dir=str(tmp_path), report_to="none",
                            per_device_train_batch_size=4, num_generations=4)
    for kw in (dict(tools=[len]), dict(rollout_func=lambda p, t: {}),
               dict(peft_config=object())):
        with pytest.raises(ValueError, match=next(iter(kw))):
            TonpGRPOTrainer(model, reward_funcs=lambda **k: [], args=args,
                            processing_class=byte_tokenizer(), **kw)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["in_process", "server"])
def test_accelerate_two_processes(tmp_path, request, mode):
    """`accelerate launch --multi_gpu --num_processes 2` (its torchrun launcher; use_cpu: gloo
    DDP): TRL's metrics stay exact, both processes end with the same (changed) weights, and the
    two halves of a prompt's group are different draws (each process its own noise keys).
    server: both processes generate on one server, rank 0 pushes, rank 1 learns the version."""
    url = [request.getfixturevalue("server").url] if mode == "server" else []
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
           "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", "0",
           str(REPO / "tests" / "trl_worker.py"), str(tmp_path), *url]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    assert [x["world"] for x in res] == [2, 2] and all(x["changed"] for x in res)
    _assert_on_policy(res[0]["log_history"], True, 1)
    w = [torch.load(tmp_path / f"weights{i}.pt") for i in range(2)]
    assert torch.equal(w[0], w[1])
    if url:
        assert res[0]["weight_version"] == res[1]["weight_version"] is not None
    for mine, theirs in zip(res[0]["rollouts"], res[1]["rollouts"]):
        assert [p for p, _ in mine] == [p for p, _ in theirs]      # one group over both ranks
        assert [c for _, c in mine] != [c for _, c in theirs]


def test_example_script(tmp_path):
    sys.path.insert(0, str(REPO / "examples"))
    import trl_grpo
    rows = trl_grpo.main(["--steps", "2", "--batch", "4", "--num-generations", "4",
                          "--max-completion-length", "4", "--out", str(tmp_path)])
    assert [r["logdiff_max"] for r in rows] == [0.0, 0.0]
    assert all(r["ratio_min"] == r["ratio_max"] == 1.0 for r in rows)


def test_a_model_split_over_ranks_is_refused():
    """TRL runs data parallel over processes: the policy must be whole on each one."""
    import dataclasses
    from tonp_models.integrations.trl import TonpPolicy
    model, _ = tiny_policy()
    model.groups = dataclasses.replace(model.groups, tp_size=2)   # as a TP=2 rank holds it
    with pytest.raises(ValueError, match=r"whole on each process.*'tp': 2"):
        TonpPolicy(model)
