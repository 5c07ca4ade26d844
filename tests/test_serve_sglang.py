"""SGLang's dialect on /generate, through the requests SGLang's own clients send (against
`python -m tonp_models.serve` on a free loopback port, prefix caching and chunked prefill on).

* SGLang's determinism check (tests/sglang_replay.py: single, mixed, prefix, and its newer
  p_vs_d (prefill vs decode logprobs) and radix_cache; greedy and seeded
  with `sampling_seed`, `return_logprob`, streamed or not) finds one output per prompt, and
  every returned logprob is bit for bit the training forward's `token_logprobs`. Twin: a
  `--mode torch` server (stock ops) gives a prompt more than one logprob sequence.
* sampling_seed: one sample per (prompt, seed) at any position and in n copies; tonp's `seed`
  keys by position (different samples).
* The door: request_ids >= 2**63 is a 400 (it used to kill the engine thread); non-neutral
  values of the features tonp lacks are refused by name; neutral ones (as slime / SkyRL send
  them) are served.
* logprob_start_len: input_token_logprobs bit for bit the training forward's, cold or cached.
* /abort_request by rid (the partial result comes back with finish_reason "abort"),
  /flush_cache, the info routes, stop strings and the stop-token trim of `text`.
"""
from __future__ import annotations

import threading

import httpx
import pytest
import torch

import sglang_replay as replay
from conftest import assert_bitwise
from serve_utils import ServerProcess, metrics, module_server, wait_until
from test_generation import tiny_model

ARGS = ["--dtype", "fp32", "--max-batch-size", "8", "--max-step-tokens", "24", "--max-n", "16"]
SAMPLINGS = {"greedy": dict(temperature=0.0, sampling_seed=42),
             "seeded": dict(temperature=1.0, sampling_seed=42)}
SMALL = dict(max_new_tokens=6, n_trials=4, long_chars=200, prefix_lens=(1, 17, 63, 130))


ckpt, server, http, _ = module_server(ARGS)


def gen(http, server, body, status=200):
    r = http.post(f"{server.url}/generate", json=body)
    assert r.status_code == status, r.text
    return r.json()


def score(seq, temperature: float) -> torch.Tensor:
    """The training forward's logprobs of seq[1:] (fp32)."""
    with torch.no_grad():
        return tiny_model(torch.float32).token_logprobs(
            [torch.tensor(list(seq))], temperature=temperature or 1.0)[0]


def check_logprobs(ckpt, rep: replay.Report, mode: str, temperature: float) -> None:
    """Every prompt's (one) logprob sequence equals the training forward's, bit for bit."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(ckpt)
    for name, samples in rep.samples.items():
        s = samples[0]
        if mode == "p_vs_d":        # the whole sequence, position 0 without a logprob
            got, want = s.logprobs[1:], score(s.output_ids, temperature)
        else:
            p = tok(rep.prompts[name], add_special_tokens=False)["input_ids"]
            got, want = s.logprobs, score(p + list(s.output_ids), temperature)[len(p) - 1:]
        assert_bitwise(torch.tensor(got, dtype=torch.float32), want,
                       f"{mode} {name}: served logprobs vs the training forward")


@pytest.mark.parametrize("mode", ["single", "mixed", "prefix", "p_vs_d", "radix_cache"])
@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_sglang_determinism_replay_finds_one_output_per_prompt(server, ckpt, mode, kind):
    kw = SAMPLINGS[kind]
    args = replay.Args(server.url, return_logprob=True, vocab=256, **kw, **SMALL)
    rep = replay.MODES[mode](args)
    want = {"p_vs_d": 2 * 4, "radix_cache": 3}.get(mode, 1 + 2 + 3 + 4)  # batches of 1..4
    assert sum(n for n, *_ in rep.unique().values()) == want
    for name, (n, texts, ids, lps) in rep.unique().items():
        assert (texts, ids, lps) == (1, 1, 1), f"{mode} {kind}: {name} gave {n} samples with " \
            f"{texts} texts, {ids} id sequences, {lps} logprob sequences"
    assert all(status == 200 for status, _ in rep.flushes), rep.flushes
    if mode != "radix_cache":
        check_logprobs(ckpt, rep, mode, kw["temperature"])
    if mode == "single" and kind == "seeded":     # streamed: SGLang's cumulative events
        args.stream = True
        streamed = replay.single(args)
        assert streamed.samples["prompt_1"][0] == rep.samples["prompt_1"][0]


def test_flush_cache_empties_the_prefix_cache(server, http):
    gen(http, server, {"input_ids": list(range(40)), "sampling_params": {"max_new_tokens": 1}})
    assert metrics(http, server.url)["tonp_prefix_cache_pages"] > 0
    for method in ("POST", "GET"):
        r = http.request(method, f"{server.url}/flush_cache")
        assert r.status_code == 200 and r.text.startswith("Cache flushed")
    assert metrics(http, server.url)["tonp_prefix_cache_pages"] == 0


def test_stock_torch_server_breaks_the_replay(ckpt):
    """Twin: with stock torch ops a prompt's logprobs change with its batch."""
    with ServerProcess(["--hf", ckpt, *ARGS, "--mode", "torch"]) as srv:
        args = replay.Args(srv.url, return_logprob=True, temperature=0.0, max_new_tokens=6,
                           n_trials=6)
        rep = replay.single(args)
    assert rep.unique()["prompt_1"][3] > 1, "stock torch unexpectedly gave one logprob sequence"


def test_sampling_seed_gives_one_sample_per_prompt_and_seed(server, http):
    a, b = [5, 6, 7, 8, 9], [9, 8, 7]
    body = {"input_ids": [a, b, a, a], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 3,
                                "n": 2}}
    out = gen(http, server, body)
    ids = [tuple(r["output_ids"]) for r in out]            # prompt-major: a a b b a a a a
    assert len(set(ids[:2] + ids[4:])) == 1 and ids[2] == ids[3] and ids[2] != ids[0]
    alone = gen(http, server, {"input_ids": a, "sampling_params": {
        "max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 3}})
    assert tuple(alone["output_ids"]) == ids[0]
    other = gen(http, server, dict(body, sampling_params=dict(body["sampling_params"],
                                                               sampling_seed=4)))
    assert tuple(other[0]["output_ids"]) != ids[0], "the seed changes the sample"
    # tonp's seed keys the noise by the sequence's place: the copies of a differ.
    tonp = gen(http, server, {"input_ids": [a] * 4, "sampling_params": {
        "max_new_tokens": 8, "temperature": 1.0, "seed": 3}})
    assert len({tuple(r["output_ids"]) for r in tonp}) > 1
    gen(http, server, {"input_ids": a, "sampling_params": {"seed": 1, "sampling_seed": 1}}, 400)


def test_request_ids_beyond_the_noise_keys_are_refused_at_the_door(server, http):
    """request_ids >= 2**63 used to overflow inside engine.step and kill the engine thread."""
    body = {"input_ids": [[1, 2, 3]], "sampling_params": {"max_new_tokens": 3,
                                                          "temperature": 1.0, "seed": 1}}
    r = http.post(f"{server.url}/generate", json=dict(body, request_ids=[2**63]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_ids", r.text
    assert "[0, 9223372036854775808)" in r.json()["error"]["message"]
    assert http.get(f"{server.url}/health").json()["status"] == "ok"
    top = gen(http, server, dict(body, request_ids=[2**63 - 1]))
    assert len(top[0]["output_ids"]) == 3
    gen(http, server, dict(body, request_ids=[-1]), 400)


@pytest.mark.parametrize("field,value", [
    ("frequency_penalty", 0.5), ("presence_penalty", -1.0), ("repetition_penalty", 1.1),
    ("min_p", 0.05), ("min_new_tokens", 2), ("stop_regex", ["a+"]), ("regex", "a+"),
    ("json_schema", "{}"), ("logit_bias", {"3": 1.0}), ("custom_params", {"k": 1}),
    ("spaces_between_special_tokens", False), ("stream_interval", 4), ("top_k", 0)])
def test_non_neutral_sampling_values_are_refused_by_name(server, http, field, value):
    r = http.post(f"{server.url}/generate", json={"input_ids": [1, 2], "sampling_params": {
        "max_new_tokens": 2, field: value}})
    assert r.status_code == 400 and r.json()["error"]["param"] == f"sampling_params.{field}"


@pytest.mark.parametrize("field,value", [("lora_path", "adapter"), ("return_hidden_states", True),
                                         ("image_data", "x.png"), ("token_ids_logprob", [1])])
def test_unsupported_request_fields_are_refused_by_name(server, http, field, value):
    r = http.post(f"{server.url}/generate", json={"input_ids": [1, 2], field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_neutral_values_as_real_clients_send_them_are_served(server, http):
    """slime / SkyRL style: every knob at its neutral value, nulls, a list of sampling_params."""
    sp = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "max_new_tokens": 4,
          "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
          "min_new_tokens": 0, "stop": [], "stop_token_ids": None, "ignore_eos": False,
          "skip_special_tokens": True, "spaces_between_special_tokens": True,
          "no_stop_trim": False, "n": 1, "json_schema": None, "regex": None,
          "sampling_seed": 5}
    out = gen(http, server, {"input_ids": [[1, 2], [3, 4]], "sampling_params": [
        sp, dict(sp, max_new_tokens=2)], "return_logprob": True, "logprob_start_len": -1,
        "top_logprobs_num": 0, "return_text_in_logprobs": True, "lora_path": None,
        "stream": False, "rid": ["a", "b"]})
    assert [r["meta_info"]["completion_tokens"] for r in out] == [4, 2]
    assert [r["meta_info"]["id"] for r in out] == ["a", "b"]
    e = out[0]["meta_info"]["output_token_logprobs"][0]
    assert e[1] == out[0]["output_ids"][0] and isinstance(e[2], str)


def test_input_token_logprobs_are_the_training_forwards_cold_or_cached(server, http):
    """logprob_start_len k: SGLang's [logprob, id, text] from prompt position k (its first
    logprob None), bit for bit the training forward's, the prefix cache cold or hit."""
    prompt = list(range(30, 70))
    body = {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0.7, "sampling_seed": 1}}
    http.post(f"{server.url}/flush_cache")
    for start in (0, 17, 17):       # cold, then a prefix-cache hit
        r = gen(http, server, dict(body, logprob_start_len=start))
        meta = r["meta_info"]
        entries = meta["input_token_logprobs"]
        assert [e[1] for e in entries] == prompt[start:] and entries[0][0] is None
        assert meta["input_top_logprobs"][0] is None
        assert [len(t) for t in meta["input_top_logprobs"][1:]] == [2] * (len(prompt) - start - 1)
        want = score(prompt + r["output_ids"], 0.7)
        got = torch.tensor([e[0] for e in entries[1:]] +
                           [e[0] for e in meta["output_token_logprobs"]], dtype=torch.float32)
        assert_bitwise(got, want[start:], f"input + output logprobs from {start}")
    assert meta["cached_tokens"] > 0
    for start in (-1, len(prompt)):
        r = gen(http, server, dict(body, logprob_start_len=start))
        assert r["meta_info"]["input_token_logprobs"] == []
    gen(http, server, dict(body, logprob_start_len=len(prompt) + 1), 400)
    two = gen(http, server, dict(body, logprob_start_len=5, sampling_params=dict(
        body["sampling_params"], n=2)))         # the prompt is scored once, for both choices
    for r in two:
        got = torch.tensor([e[0] for e in r["meta_info"]["input_token_logprobs"][1:]])
        assert_bitwise(got, score(prompt, 0.7)[5:], "n = 2: each choice's prompt logprobs")


def test_stop_strings_end_the_text_as_sglang_does(server, http):
    p = {"input_ids": [10, 11, 12], "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                        "skip_special_tokens": False}}
    free = gen(http, server, p)
    stop = free["text"][2:4]
    cut = free["text"].index(stop)
    r = gen(http, server, dict(p, sampling_params=dict(p["sampling_params"], stop=[stop])))
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert r["text"] == free["text"][:cut]
    assert free["output_ids"][:len(r["output_ids"])] == r["output_ids"]
    kept = gen(http, server, dict(p, sampling_params=dict(p["sampling_params"], stop=stop,
                                                          no_stop_trim=True)))
    assert kept["text"] == free["text"][:cut + len(stop)]


def test_text_trims_the_matched_stop_token_unless_no_stop_trim(server, http, ckpt):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(ckpt)
    p = {"input_ids": [10, 11, 12], "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    free = gen(http, server, p)["output_ids"]
    stop = free[2]
    sp = dict(p["sampling_params"], stop_token_ids=[stop])
    r = gen(http, server, dict(p, sampling_params=sp))
    k = free.index(stop) + 1
    assert r["output_ids"] == free[:k] and r["meta_info"]["finish_reason"] == {
        "type": "stop", "matched": stop}
    assert r["text"] == tok.decode(free[:k - 1])
    kept = gen(http, server, dict(p, sampling_params=dict(sp, no_stop_trim=True)))
    assert kept["text"] == tok.decode(free[:k])


def test_abort_request_by_rid_returns_the_partial_result(server, http):
    got = {}

    def long_request(rid):
        with httpx.Client(timeout=120) as c:
            got[rid] = c.post(f"{server.url}/generate", json={
                "input_ids": [1, 2, 3], "rid": rid, "sampling_params": {
                    "max_new_tokens": 900, "ignore_eos": True, "temperature": 1.0}})

    for rid, body in (("slow-1", {"rid": "slow-1"}), ("slow-2", {"abort_all": True})):
        t = threading.Thread(target=long_request, args=(rid,))
        t.start()
        wait_until(lambda: metrics(http, server.url)["tonp_num_requests_running"] >= 1,
                   what="the request to run")
        assert http.post(f"{server.url}/abort_request", json=body).status_code == 200
        t.join(60)
        r = got[rid]
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 900
    assert http.post(f"{server.url}/abort_request", json={"rid": "gone"}).status_code == 200


def test_info_routes(server, http):
    m = http.get(f"{server.url}/get_model_info").json()
    assert m["is_generation"] is True and m["model_path"] == m["served_model_name"]
    s = http.get(f"{server.url}/get_server_info").json()
    assert (s["context_length"], s["tp_size"], s["dp_size"], s["max_running_requests"],
            s["chunked_prefill_size"]) == (1024, 1, 1, 8, 24)
    assert s["max_total_num_tokens"] > 0
    assert http.get(f"{server.url}/model_info").json() == m
    assert http.get(f"{server.url}/health_generate").status_code == 200
