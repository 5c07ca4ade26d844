"""The rollout service, through real clients (the official `openai` package, httpx, and tonp's
RolloutClient) against `python -m tonp_models.serve` started on a free loopback port, with
prefix caching and chunked prefill (24-token steps) on.

* "logdiff is 0 over HTTP": the logprobs the server returns (completions, chat with the
  checkpoint's template, streamed or not, and the token-id /generate) equal, bit for bit, the
  training forward's `model.token_logprobs` of the same tokens.
* /generate reproduces `tonp_models.generate` bit for bit (tokens, logprobs, finish reasons).
* G samples of one prompt prefill it once (the server's prefill counter).
* /update_weights: no request lost (an in-flight request finishes with the old weights), the
  prefix cache is invalidated, later requests get the new weights' bits; a bad checkpoint is
  refused and the server keeps serving (the failure cases: test_serve_weights.py).
* examples/grpo.py --server rolls out through the server: logdiff 0, ratios exactly 1.
"""
from __future__ import annotations

import os
import sys
import threading

import httpx
import torch

from conftest import assert_bitwise
from serve_utils import metrics, module_server, tiny_checkpoint
from test_generation import prompts, tiny_model
from tonp_models import generate
from tonp_models.serve import RolloutClient


NAME = "tiny"
ARGS = ["--dtype", "fp32", "--served-model-name", NAME, "--max-batch-size", "16",
        "--max-step-tokens", "24", "--max-n", "32"]


# weights may come from pytest's base temporary directory (the tests' tmp_path dirs are below)
ckpt, server, http, oai = module_server(
    ARGS, extra=lambda path: ["--allowed-weights-dir", os.path.dirname(path)])


def score(model, prompt, completion, temperature):
    """The training forward's logprobs of `completion` after `prompt` (fp32)."""
    with torch.no_grad():
        lp = model.token_logprobs([torch.tensor(list(prompt) + list(completion))],
                                  temperature=temperature or 1.0)[0]
    return lp[len(prompt) - 1:]


def test_completions_logprobs_equal_the_training_forward(oai, http, server):
    model = tiny_model(torch.float32)
    p = prompts((60,), seed=21)[0].tolist()         # 60 tokens: prefilled in 24-token chunks
    before = metrics(http, server.url)
    r = oai.completions.create(model=NAME, prompt=p, max_tokens=8, temperature=1.0, seed=5, n=3,
                               logprobs=0, extra_body={"ignore_eos": True})
    after = metrics(http, server.url)
    # 3 samples: the prompt went through the model once, the 2 others fed its last token only
    assert after["tonp_prefill_tokens_total"] - before["tonp_prefill_tokens_total"] == 60 + 2
    assert r.usage.prompt_tokens == 60 and r.usage.prompt_tokens_details.cached_tokens == 0
    assert len({tuple(c.token_ids) for c in r.choices}) > 1
    for c in r.choices:
        assert len(c.token_ids) == 8 and c.finish_reason == "length"
        got = torch.tensor(c.logprobs.token_logprobs, dtype=torch.float32)
        assert_bitwise(got, score(model, p, c.token_ids, 1.0), f"choice {c.index}")
    # streamed, the same request gives the same bits (now wholly from the prefix cache)
    stream = oai.completions.create(model=NAME, prompt=p, max_tokens=8, temperature=1.0,
                                    seed=5, n=3, logprobs=0, stream=True,
                                    stream_options={"include_usage": True},
                                    extra_body={"ignore_eos": True})
    ids, lps, usage = {}, {}, []
    for chunk in stream:
        for c in chunk.choices:
            ids.setdefault(c.index, []).extend(c.token_ids)
            lps.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
        usage += [chunk.usage] if chunk.usage is not None else []
    assert [u.prompt_tokens_details.cached_tokens for u in usage] == [59]   # 59 of 60 cached
    for c in r.choices:
        assert ids[c.index] == c.token_ids and lps[c.index] == c.logprobs.token_logprobs


def test_chat_uses_the_checkpoint_template_and_keeps_every_bit(oai, ckpt):
    from transformers import AutoTokenizer
    model, tok = tiny_model(torch.float32), AutoTokenizer.from_pretrained(ckpt)
    messages = [{"role": "system", "content": "Copy the digits."},
                {"role": "user", "content": "407>"}]
    prompt = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    kw = dict(model=NAME, messages=messages, max_tokens=6, temperature=0.8, seed=3,
              logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    r = oai.chat.completions.create(**kw)
    c = r.choices[0]
    assert r.usage.prompt_tokens == len(prompt)
    assert c.message.content == tok.decode(c.token_ids, skip_special_tokens=True)
    got = torch.tensor([t.logprob for t in c.logprobs.content], dtype=torch.float32)
    assert_bitwise(got, score(model, prompt, c.token_ids, 0.8), "chat logprobs")
    for t in c.logprobs.content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.logprob
    text, toks = "", []
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for d in chunk.choices:
            text += d.delta.content or ""
            toks += d.token_ids
    assert toks == c.token_ids and text == c.message.content


def test_generate_endpoint_reproduces_generate(server, http):
    """SGLang-style /generate (through RolloutClient): G samples of P prompts with their noise
    keys give generate's tokens, logprobs and finish reasons, bit for bit, and each result names
    the weight version that generated it."""
    model = tiny_model(torch.float32)
    group = [p for p in prompts((5, 30, 17), seed=22) for _ in range(2)]
    kw = dict(temperature=1.0, seed=9, request_ids=range(100, 106), eos_token_id=257)
    want = generate(model, group, 10, **kw)
    client = RolloutClient(server.url)
    version = client.wait_ready()["weight_version"]
    got = client.generate(group, 10, **kw)
    for i in range(len(group)):
        assert_bitwise(got.sequences[i], want.sequences[i], f"request {i}: tokens")
        assert_bitwise(got.logprobs[i], want.logprobs[i], f"request {i}: logprobs")
    assert got.finish_reasons == want.finish_reasons
    assert got.weight_versions == [version] * len(group)
    one = http.post(f"{server.url}/generate", json={
        "input_ids": group[0].tolist(), "return_logprob": True, "top_logprobs_num": 3,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).json()
    assert one["output_ids"] == generate(model, group[:1], 4).completions[0].tolist()
    assert [len(t) for t in one["meta_info"]["output_top_logprobs"]] == [3] * 4


def test_a_temperature_whose_logits_overflow_fails_only_its_request(server, http):
    """fp32's smallest normal temperature is valid but this model's logits / T overflow: that
    request gets a 400 naming the temperature (streamed: an error event), the server goes on."""
    tiny = torch.finfo(torch.float32).tiny
    r = http.post(server.url + "/v1/completions", json={"prompt": [1, 2], "temperature": tiny})
    assert r.status_code == 400 and "overflow fp32" in r.json()["error"]["message"]
    with http.stream("POST", server.url + "/v1/completions", json={
            "prompt": [1, 2], "temperature": tiny, "stream": True}) as s:
        lines = [x for x in s.iter_lines() if x]
    assert "overflow fp32" in lines[0] and lines[-1] == "data: [DONE]"
    assert http.get(server.url + "/health").json()["status"] == "ok"


def _update(http, url, path):
    return http.post(f"{url}/update_weights", json={"model_path": str(path)})


def test_update_weights_loses_no_request_and_invalidates_the_prefix_cache(server, http, ckpt,
                                                                         tmp_path):
    old = tiny_model(torch.float32)
    torch.manual_seed(7)
    new = type(old)(old.config)
    path = tiny_checkpoint(tmp_path / "new", new, tokenizer=False)
    p = prompts((40,), seed=23)[0].tolist()
    body = {"prompt": p, "max_tokens": 200, "temperature": 0, "stream": True, "logprobs": 0,
            "ignore_eos": True}
    got, first = {"ids": [], "lps": []}, threading.Event()

    def stream():
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    c = httpx.Response(200, content=line[6:]).json()["choices"][0]
                    got["ids"] += c["token_ids"]
                    got["lps"] += c["logprobs"]["token_logprobs"]
                    first.set()
    t = threading.Thread(target=stream)
    t.start()
    try:
        assert first.wait(30)
        version = http.get(f"{server.url}/health").json()["weight_version"]
        r = _update(http, server.url, path)          # waits for the running request to finish
        t.join(60)
        assert r.status_code == 200 and r.json()["success"], r.text
        assert r.json()["weight_version"] == version + 1
        # the in-flight request finished, all with the old weights
        assert len(got["ids"]) == 200
        assert_bitwise(torch.tensor(got["lps"]), score(old, p, got["ids"], 0), "in flight")
        # the same prompt again: nothing cached any more, the new weights' bits
        r = http.post(f"{server.url}/v1/completions", json=dict(body, stream=False,
                                                                max_tokens=5)).json()
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        c = r["choices"][0]
        assert_bitwise(torch.tensor(c["logprobs"]["token_logprobs"]),
                       score(new, p, c["token_ids"], 0), "after the update")
        # refused checkpoints: the weights stay, the server keeps serving (more cases:
        # test_serve_weights.py)
        for bad, why in ((tmp_path / "missing", "is not a checkpoint directory"),
                         (_other_shape(tmp_path), "does not match the running model")):
            r = _update(http, server.url, bad)
            assert r.status_code == 400 and why in r.json()["message"], r.text
        assert http.get(f"{server.url}/health").json() == {"status": "ok",
                                                          "weight_version": version + 1}
        g = http.post(f"{server.url}/generate", json={"input_ids": p}).json()
        assert g["meta_info"]["weight_version"] == version + 1
    finally:
        t.join(60)
        assert _update(http, server.url, ckpt).status_code == 200     # the original weights
        assert http.get(f"{server.url}/health").json()["status"] == "ok"


def _other_shape(tmp_path):
    from tonp_models import Qwen3MoeConfig, Qwen3MoeForCausalLM
    m = Qwen3MoeForCausalLM(Qwen3MoeConfig.preset("tiny", num_hidden_layers=1))
    return tiny_checkpoint(tmp_path / "other", m, tokenizer=False)


def test_grpo_rolls_out_through_the_server(server, ckpt, tmp_path):
    """examples/grpo.py --server: each step pushes the policy's weights to the server and rolls
    out there; the training forward still matches the rollout bit for bit."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
    import grpo
    try:
        res = grpo.main(["--server", server.url, "--steps", "2", "--sft-steps", "0",
                         "--prompts", "2", "--group-size", "4", "--inner-steps", "1",
                         "--threads", "1", "--no-progress", "--no-export", "--out",
                         str(tmp_path), "--set", "num_hidden_layers=2", "--set",
                         "mlp_only_layers=[1]", "--set", "initializer_range=0.02"])
        for r in res["rows"]:
            assert r["logdiff"] == 0.0 and r["ratio_is_one"], r
        health = RolloutClient(server.url).wait_ready()
        assert health["weight_version"] >= 2
    finally:
        RolloutClient(server.url).update_weights(ckpt)


def test_serve_bench_runs_end_to_end(tmp_path):
    """benchmarks/serve_bench.py on a toy workload (no timing asserted: it must not rot); the
    prefix cache computes fewer prefill tokens, and the server's tokens are the engine's."""
    import json
    import subprocess
    bench = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks",
                         "serve_bench.py")
    p = subprocess.run([sys.executable, bench, "--quick", "--prompts", "2", "--group", "3",
                        "--rounds", "1", "--system-len", "16", "--prompt-len", "20", "--new",
                        "3", "--out", str(tmp_path)], capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads((tmp_path / "serve_quick.json").read_text())
    on, off = data["cases"]["engine, prefix cache"], data["cases"]["engine, no prefix cache"]
    assert on["prefill_tokens"] < off["prefill_tokens"] == 2 * 3 * 36
    assert "| server, prefix cache |" in (tmp_path / "serve_quick.md").read_text()


def test_service_update_drains_running_requests_and_gives_waiting_ones_the_new_weights():
    """EngineService alone (no HTTP): with one running slot, request a has produced a token
    when the update is asked; it finishes with the old weights, then the update runs, then the
    waiting request b starts with the new ones (and finds no stale prefix in the cache)."""
    import copy

    from tonp_models.engine import Engine, Request, SamplingParams
    from tonp_models.serve.service import EngineService
    old = tiny_model(torch.float32)
    new, model = copy.deepcopy(old), copy.deepcopy(old)
    with torch.no_grad():
        new.lm_head.weight.mul_(0.5)
    service = EngineService(Engine(model, max_batch_size=1),
                            lambda path: model.load_state_dict(new.state_dict()))
    got = {"a": [], "b": []}
    started, finished = threading.Event(), threading.Event()

    def sink(out):                                   # on the engine thread
        if out.token is not None:
            got[out.request.key].append(out.logprob)
            started.set()
        if out.finish and out.request.key == "b":
            finished.set()
    p = prompts((20,), seed=25)[0].tolist()
    service.start()
    try:
        service.submit([Request("a", p, SamplingParams(40, 0.0)),
                        Request("b", p, SamplingParams(5, 0.0))], sink)
        assert started.wait(30)
        ok, message, _ = service.update_weights("new").result(60)
        assert ok and service.weight_version == 1, message
        assert finished.wait(30)
    finally:
        service.shutdown()
    a = generate(old, [p], 40).logprobs[0]
    b = generate(new, [p], 5).logprobs[0]
    assert_bitwise(torch.tensor(got["a"]), a, "a: all with the old weights")
    assert_bitwise(torch.tensor(got["b"]), b, "b: all with the new weights")
    assert service.engine.stats.cached_tokens == 0      # a's pages were dropped by the update
