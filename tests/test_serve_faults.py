"""The rollout service under bad input, load and faults (a tiny preset server per test module,
on a free loopback port, always torn down):

* every bad request is a 4xx whose message names the problem, and the server keeps serving;
* a client that disconnects (mid-stream, or while waiting for a whole response) frees its
  requests and their pages;
* 64 concurrent clients, 256 requests through a cache small enough to make requests wait and be
  preempted: every request completes (none lost, none failed), with exact logprobs;
* SIGTERM shuts down gracefully: the running request finishes, the process exits with 0;
* under torchrun-style ranks (TP 2, EP 2), rank 0 serves and both ranks step in lockstep: the
  logprobs are the single-process training forward's, bit for bit.
"""
from __future__ import annotations

import asyncio
import random

import httpx
import pytest
import torch

from conftest import assert_bitwise
from dist_utils import free_port
from serve_utils import ServerProcess, metrics, module_server, rank_env, tiny_checkpoint, \
    wait_until
from test_generation import prompts, tiny_model

# 64 pages of 16 positions: the load test's 64 clients do not all fit at once.
ARGS = ["--preset", "tiny", "--set", "num_hidden_layers=2", "--set", "mlp_only_layers=[1]",
        "--max-batch-size", "16", "--num-pages", "64", "--max-step-tokens", "64",
        "--max-n", "8", "--max-model-len", "512"]


_, server, http, _ = module_server(ARGS, hf=False)


def _model():
    from tonp_models import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(0)  # what --preset tiny builds (--seed 0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig.preset("tiny", num_hidden_layers=2,
                                                     mlp_only_layers=[1])).eval()


BAD = [  # (path, body (dict, or raw bytes), status, words the message must hold)
    ("/v1/completions", b'{"prompt": [1, 2', 400, "malformed JSON"),
    ("/v1/completions", b"[1, 2]", 400, "body: Input should be an object"),
    ("/v1/completions", {"prompt": [1, 2], "temprature": 1.0}, 400, "unknown field 'temprature'"),
    ("/v1/completions", {"prompt": [1, 320]}, 400, "token ids [320] outside the vocabulary"),
    ("/v1/completions", {"prompt": [1, -1]}, 400, "token ids [-1] outside the vocabulary"),
    ("/v1/completions", {"prompt": [1] * 600}, 400, "context is 512 tokens"),
    ("/v1/completions", {"prompt": [1] * 500, "max_tokens": 20}, 400, "exceeds the model's "
     "context of 512"),
    ("/v1/completions", {"prompt": [1, 2], "n": 9}, 400, "n=9"),
    ("/v1/completions", {"prompt": [[1], [2], [3]], "n": 3}, 400, "limit of 8"),
    ("/v1/completions", {"prompt": [1, 2], "temperature": -0.5}, 400, "temperature must be"),
    ("/v1/completions", {"prompt": [1, 2], "temperature": 1e-300}, 400, "got 1e-300"),
    ("/v1/completions", {"prompt": [1, 2], "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": [1, 2], "top_p": 0}, 400, "top_p must be in (0, 1]"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": -1}, 400, "max_tokens must be >= 0"),
    ("/v1/completions", {"prompt": [1, 2], "n": True}, 400, "n: Input should be a valid int"),
    ("/v1/completions", {"prompt": [1, 2], "presence_penalty": 1}, 400, "presence_penalty is "
     "not supported"),
    ("/v1/completions", {"prompt": [1, 2], "stop": "\n"}, 400, "use stop_token_ids"),
    ("/v1/completions", {"prompt": "hello"}, 400, "no tokenizer"),
    ("/v1/completions", {"prompt": [1], "model": "gpt-4"}, 404, "'gpt-4' does not exist"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400,
     "needs the checkpoint's chat template"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"seed": -3}}, 400, "seed must be"),
    ("/generate", {"input_ids": [[1], [2]], "request_ids": [4, 4]}, 400, "distinct"),
    ("/generate", {"input_ids": [5], "sampling_params": {"stop_token_ids": [999]}}, 400,
     "stop_token_ids[0] must be in [0, 320)"),
    ("/generate", {"sampling_params": {}}, 400, "exactly one of input_ids and text"),
    ("/update_weights", {"model_path": "/tmp", "path": 1}, 400, "unknown field 'path'"),
    ("/update_weights", {}, 400, "model_path: Field required"),
]


@pytest.mark.parametrize("path, body, status, words", BAD,
                         ids=[f"{p}:{w[:30]}" for p, _, _, w in BAD])
def test_bad_requests_get_a_4xx_naming_the_problem(server, http, path, body, status, words):
    kw = {"content": body, "headers": {"Content-Type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body}
    r = http.post(server.url + path, **kw)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"], r.json()
    ok = http.post(server.url + "/v1/completions",  # unseeded: eos may come, so it is ignored
                   json={"prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 2


def test_a_client_that_disconnects_frees_its_request_and_pages(server, http):
    """A stream closed after 3 chunks, and a client giving up on a whole response (8 samples of
    505 tokens, 2 at a time in the 64-page cache): their requests are aborted, pages freed."""
    body = {"prompt": [1, 2, 3], "max_tokens": 505, "ignore_eos": True}
    key = 'tonp_requests_finished_total{reason="abort"}'
    aborted = metrics(http, server.url).get(key, 0)
    with http.stream("POST", server.url + "/v1/completions", json=dict(body, stream=True)) as s:
        for i, _ in zip(range(3), s.iter_lines()):
            pass
    with pytest.raises(httpx.ReadTimeout):
        http.post(server.url + "/v1/completions", json=dict(body, n=8), timeout=0.2)

    def freed():
        m = metrics(http, server.url)
        return m.get(key, 0) >= aborted + 2 and m["tonp_num_requests_running"] == 0 and \
            m["tonp_num_requests_waiting"] == 0 and m["tonp_kv_cache_pages_used"] == 0
    wait_until(freed, 20, "the requests aborted and their pages freed")


async def _load(url: str, n_clients: int, n_requests: int):
    """n_requests completions from n_clients concurrent clients -> [(body, response json)]."""
    rng = random.Random(0)
    shared = [rng.randrange(256) for _ in range(40)]
    bodies = []
    for i in range(n_requests):
        p = shared[:rng.randrange(1, 40)] if i % 2 else \
            [rng.randrange(256) for _ in range(rng.randrange(1, 60))]
        bodies.append({"prompt": p, "max_tokens": rng.randrange(1, 9), "temperature": 1.0,
                       "seed": i, "logprobs": 0, "ignore_eos": True})
    todo = asyncio.Queue()
    for b in bodies:
        todo.put_nowait(b)
    out = []
    limits = httpx.Limits(max_connections=n_clients)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def worker():
            while not todo.empty():
                b = todo.get_nowait()
                r = await client.post(f"{url}/v1/completions", json=b)
                out.append((b, r.status_code, r.json()))
        await asyncio.gather(*[worker() for _ in range(n_clients)])
    return out


def test_64_clients_256_requests_all_complete(server, http):
    before = metrics(http, server.url)
    done = asyncio.run(_load(server.url, 64, 256))
    after = metrics(http, server.url)
    assert len(done) == 256 and all(s == 200 for _, s, _ in done), \
        [r for _, s, r in done if s != 200][:3]
    for b, _, r in done:
        c = r["choices"][0]
        assert len(c["token_ids"]) == b["max_tokens"] and c["finish_reason"] == "length"
    key = 'tonp_requests_finished_total{reason="length"}'
    assert after[key] - before.get(key, 0) == 256
    assert after["tonp_num_requests_running"] == after["tonp_num_requests_waiting"] == 0
    hits = "tonp_prefix_cache_hit_tokens_total"
    assert after[hits] > before[hits]
    model = _model()
    sample = random.Random(1).sample(done, 16)
    seqs = [torch.tensor(b["prompt"] + r["choices"][0]["token_ids"]) for b, _, r in sample]
    with torch.no_grad():
        train = model.token_logprobs(seqs, temperature=1.0)
    for (b, _, r), lp in zip(sample, train):
        assert_bitwise(torch.tensor(r["choices"][0]["logprobs"]["token_logprobs"]),
                       lp[len(b["prompt"]) - 1:], f"request with seed {b['seed']}")


def _stream_then_sigterm(srv, body):
    """Start a stream, SIGTERM the server after its first chunk; the lines that followed."""
    rest = []
    with httpx.Client(timeout=60) as c, c.stream("POST", srv.url + "/v1/completions",
                                                 json=dict(body, stream=True)) as s:
        lines = s.iter_lines()
        next(lines)
        srv.proc.send_signal(15)
        rest += [x for x in lines if x]
    return rest


def test_sigterm_finishes_the_running_request_and_exits_cleanly():
    with ServerProcess(ARGS + ["--graceful-timeout", "20"]) as srv:
        rest = _stream_then_sigterm(srv, {"prompt": [1, 2], "max_tokens": 300,
                                          "ignore_eos": True})
        assert srv.proc.wait(30) == 0, srv.log
    assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in rest[-2]


def test_sigterm_cancels_what_outlasts_the_graceful_timeout_and_exits_cleanly():
    """8 x 500 tokens, 2 at a time (64 pages): far beyond a 0.3 s grace; what is left is
    aborted, the stream ends with finish_reason "abort" and [DONE], the process exits with 0."""
    with ServerProcess(ARGS + ["--graceful-timeout", "0.3"]) as srv:
        rest = _stream_then_sigterm(srv, {"prompt": [1, 2], "max_tokens": 500, "n": 8,
                                          "ignore_eos": True})
        assert srv.proc.wait(30) == 0, srv.log
    assert rest[-1] == "data: [DONE]" and '"finish_reason": "abort"' in "".join(rest)
    assert "Traceback" not in srv.log and "ERROR" not in srv.log, srv.log


@pytest.mark.parametrize("layout", [["--tp", "2"], ["--ep", "2"]], ids=["tp2", "ep2"])
def test_two_rank_server_steps_both_ranks_in_lockstep(tmp_path, layout):
    """Two ranks as torchrun starts them (TP 2, or EP 2): rank 0 serves, rank 1 follows its
    broadcast ticks; logprobs equal the one-process training forward's; SIGTERM stops both."""
    model = tiny_model(torch.float32)
    ckpt = tiny_checkpoint(tmp_path / "ckpt", model, tokenizer=False)
    port, args = free_port(), ["--hf", ckpt, "--dtype", "fp32", *layout,
                               "--max-step-tokens", "16", "--max-batch-size", "8"]
    with ServerProcess(args, env=rank_env(1, port), announce=False) as follower, \
            ServerProcess(args, env=rank_env(0, port)) as srv, httpx.Client(timeout=60) as c:
        ps = [p.tolist() for p in prompts((30, 7, 45), seed=24)]
        r = c.post(srv.url + "/generate", json={
            "input_ids": ps, "return_logprob": True, "request_ids": [0, 1, 2],
            "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "seed": 2,
                                "ignore_eos": True}}).json()
        seqs = [torch.tensor(p + x["output_ids"]) for p, x in zip(ps, r)]
        with torch.no_grad():
            train = model.token_logprobs(seqs, temperature=1.0)
        for p, x, lp in zip(ps, r, train):
            got = torch.tensor([v[0] for v in x["meta_info"]["output_token_logprobs"]])
            assert_bitwise(got, lp[len(p) - 1:], f"{layout} server vs the training forward")
        # vLLM's prompt_logprobs: every rank scores the prompt in the same forward
        assert c.post(srv.url + "/reset_prefix_cache").json()["success"] is True
        ch = c.post(srv.url + "/v1/completions", json={
            "prompt": ps[0], "max_tokens": 1, "prompt_logprobs": 2}).json()["choices"][0]
        got = torch.tensor([e[str(t)]["logprob"] for e, t in zip(ch["prompt_logprobs"][1:],
                                                                 ps[0][1:])])
        with torch.no_grad():
            want = model.token_logprobs([torch.tensor(ps[0])])[0]
        assert_bitwise(got, want, f"{layout} prompt logprobs vs the training forward")
        assert srv.stop() == 0, srv.log
        assert follower.proc.wait(30) == 0, follower.log
