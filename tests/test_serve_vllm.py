"""vLLM's OpenAI dialect, through real clients: the official `openai` package and TRL's
`VLLMClient` (its own generate / chat / scoring / cache calls, unchanged), against
`python -m tonp_models.serve` on a free loopback port (tiny checkpoint, byte-level tokenizer).

* vLLM's sampling extras are accepted at their neutral values (TRL's body: repetition_penalty 1,
  top_k 0, min_p 0, return_token_ids, return_tokens_as_token_ids) and refused by name otherwise.
* prompt_logprobs (vLLM's format) and echo + logprobs (OpenAI's, as lm-eval sends it) equal
  `model.token_logprobs` of the prompt bit for bit, cold and with the prefix cache hit.
* stop strings: generation ends at the token whose text completes one; the text is cut there
  (kept with include_stop_str_in_output), token_ids and logprobs are exactly the tokens
  generated, streamed or not, for each of n choices; the request is aborted at the stop.
* /reset_prefix_cache, /server_info, /get_world_size, /version; the door's bounds (prompt
  characters before tokenizing, logprob counts, stop strings).
"""
from __future__ import annotations

import httpx
import pytest
import torch

from conftest import assert_bitwise
from serve_utils import metrics, module_server, wait_until
from test_generation import prompts, tiny_model


NAME = "tiny"
MAX_CHARS = 3000
ARGS = ["--dtype", "fp32", "--served-model-name", NAME, "--max-batch-size", "8",
        "--max-step-tokens", "24", "--max-n", "8", "--max-logprobs", "8",
        "--max-prompt-chars", str(MAX_CHARS)]


ckpt, server, http, oai = module_server(ARGS)


@pytest.fixture(scope="module")
def tok(ckpt):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(ckpt)


def lps(model, seq, temperature=1.0) -> torch.Tensor:
    with torch.no_grad():
        return model.token_logprobs([torch.tensor(list(seq))], temperature=temperature)[0]


def f32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# -- vLLM's fields ------------------------------------------------------------------------------
def test_trls_completion_body_is_served_with_token_ids(oai):
    model = tiny_model(torch.float32)
    p = prompts((12,), seed=41)[0].tolist()
    r = oai.completions.create(model=NAME, prompt=p, n=2, max_tokens=6, temperature=1.0,
                               top_p=1.0, seed=3, logprobs=0, extra_body=dict(
                                   repetition_penalty=1.0, top_k=0, min_p=0.0,
                                   return_token_ids=True, return_tokens_as_token_ids=True,
                                   ignore_eos=True))
    for c in r.choices:
        assert c.prompt_token_ids == p and len(c.token_ids) == 6
        assert c.logprobs.tokens == [f"token_id:{t}" for t in c.token_ids]
        # vLLM's top_logprobs: the token itself, at logprobs=0 only it
        assert c.logprobs.top_logprobs == [{s: v} for s, v in zip(c.logprobs.tokens,
                                                                  c.logprobs.token_logprobs)]
        assert_bitwise(f32(c.logprobs.token_logprobs), lps(model, p + c.token_ids)[len(p) - 1:])


NEUTRAL_OK = dict(repetition_penalty=1, min_p=0, top_k=-1, presence_penalty=0,
                  frequency_penalty=0.0, min_tokens=0, length_penalty=1.0, use_beam_search=False,
                  skip_special_tokens=True, spaces_between_special_tokens=True,
                  include_stop_str_in_output=False, truncate_prompt_tokens=None,
                  add_special_tokens=True, priority=0, logit_bias={}, user="u", best_of=1,
                  allowed_token_ids=None, bad_words=[], guided_json=None, structured_outputs=None,
                  response_format={"type": "text"}, stop_token_ids=[], stop=[], echo=False,
                  return_token_ids=False, prompt_logprobs=None)

REFUSED = [("repetition_penalty", 1.1), ("min_p", 0.05), ("presence_penalty", 0.5),
           ("frequency_penalty", -1), ("min_tokens", 2), ("length_penalty", 0.5),
           ("use_beam_search", True), ("spaces_between_special_tokens", False),
           ("truncate_prompt_tokens", 4), ("allowed_token_ids", [1, 2]), ("bad_words", ["a"]),
           ("logit_bias", {"5": 3.0}), ("priority", 1), ("guided_regex", "a+"),
           ("guided_choice", ["a"]), ("structured_outputs", {"regex": "a"}),
           ("response_format", {"type": "json_object"}), ("best_of", 2), ("suffix", "x"),
           ("cache_salt", "salt"), ("logits_processors", ["m.f"]), ("vllm_xargs", {"a": 1}),
           ("top_k", -2), ("temprature", 1.0)]


def test_neutral_values_are_accepted(http, server):
    r = http.post(f"{server.url}/v1/completions", json=dict(
        prompt=[5, 6, 7], max_tokens=2, ignore_eos=True, **NEUTRAL_OK))
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["token_ids"]) == 2


@pytest.mark.parametrize("field, value", REFUSED, ids=[f for f, _ in REFUSED])
def test_a_value_tonp_does_not_implement_is_refused_by_name(http, server, field, value):
    r = http.post(f"{server.url}/v1/completions",
                  json={"prompt": [5, 6, 7], "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err


@pytest.mark.parametrize("field, value", [("echo", True), ("tools", [{"type": "function"}]),
                                          ("tool_choice", "required"),
                                          ("continue_final_message", True),
                                          ("reasoning_effort", "low")])
def test_chat_refuses_what_it_does_not_implement_by_name(http, server, field, value):
    r = http.post(f"{server.url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


# -- prompt logprobs and echo ---------------------------------------------------------------------
def _prompt_lp(entry, token):
    return entry[str(token)]["logprob"]


def test_prompt_logprobs_are_the_training_forwards_cold_and_cached(oai, http, server, tok):
    model = tiny_model(torch.float32)
    p = prompts((50,), seed=42)[0].tolist()      # 50 tokens: 3 full pages to cache
    want = lps(model, p)
    http.post(f"{server.url}/reset_prefix_cache")
    seen = []
    for attempt in ("cold", "cached"):
        r = oai.completions.create(model=NAME, prompt=p, max_tokens=1, temperature=0, n=2,
                                   extra_body={"prompt_logprobs": 3})
        c = r.choices[0]       # the prompt is scored once, both choices carry it
        assert r.choices[1].prompt_logprobs == c.prompt_logprobs
        seen.append(r.usage.prompt_tokens_details.cached_tokens)
        assert c.prompt_token_ids == p and c.prompt_logprobs[0] is None
        got = f32([_prompt_lp(e, t) for e, t in zip(c.prompt_logprobs[1:], p[1:])])
        assert_bitwise(got, want, attempt)
        for e, t in zip(c.prompt_logprobs[1:], p[1:]):
            mine = e[str(t)]["rank"]       # the prompt's token, then the top 3 by rank
            assert {v["rank"] for v in e.values()} == {1, 2, 3} | {mine}
            assert len(e) == (3 if mine <= 3 else 4) and list(e)[0] == str(t)
            assert all(v["decoded_token"] == tok.decode([int(k)]) for k, v in e.items())
    assert seen[0] == 0 and seen[1] >= 48, seen


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_echo_with_logprobs_as_lm_eval_sends_it(http, server, tok, max_tokens):
    model = tiny_model(torch.float32)
    p = prompts((20,), seed=43)[0].tolist()
    body = {"model": NAME, "prompt": [p], "temperature": 0, "max_tokens": max_tokens,
            "logprobs": 1, "seed": 1234, "echo": True}
    c = http.post(f"{server.url}/v1/completions", json=body).json()["choices"][0]
    gen = c["token_ids"]
    assert len(gen) == max_tokens
    lp = c["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["token_logprobs"]) == len(p) + max_tokens
    assert_bitwise(f32(lp["token_logprobs"][1:]), lps(model, p + gen))
    assert c["text"] == tok.decode(p + gen, skip_special_tokens=True)
    assert lp["tokens"] == [tok.decode([t]) for t in p + gen]
    assert lp["text_offset"][0] == 0
    for t, v, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert top[t] == v and 1 <= len(top) <= 2 and max(top.values()) >= v


# -- stop strings ---------------------------------------------------------------------------------
def _stop_case(http, server, tok):
    """A greedy completion and a two-character stop string its text holds past the first
    token (found, not assumed: the tiny model's text is what it is)."""
    for seed in range(44, 60):
        p = prompts((10,), seed=seed)[0].tolist()
        full = http.post(f"{server.url}/v1/completions", json={
            "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}).json()["choices"][0]
        text = full["text"]
        for j in range(1, len(text) - 1):
            s = text[j:j + 2]
            if s.isascii() and s.isprintable() and text.index(s) == j:
                return p, full, s
    raise AssertionError("no printable stop string in 16 greedy completions")


def _expected(tok, tokens, s, include):
    """vLLM's semantics from the tokenizer alone: the first token whose text completes s."""
    for m in range(len(tokens)):
        t = tok.decode(tokens[:m + 1], skip_special_tokens=True)
        if s in t:
            i = t.index(s)
            return tokens[:m + 1], t[:i + len(s) if include else i]
    return tokens, tok.decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_ends_the_completion_where_vllm_does(http, server, tok, include):
    p, full, s = _stop_case(http, server, tok)
    want_ids, want_text = _expected(tok, full["token_ids"], s, include)
    assert len(want_ids) < len(full["token_ids"])
    finished = metrics(http, server.url).get('tonp_requests_finished_total{reason="abort"}', 0)
    # max_tokens far beyond the stop: the abort lands long before the engine would finish
    body = {"prompt": p, "max_tokens": 900, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "stop": [s, "\x00never"], "include_stop_str_in_output": include}
    made = metrics(http, server.url)["tonp_generation_tokens_total"]
    c = http.post(f"{server.url}/v1/completions", json=body).json()["choices"][0]
    assert (c["text"], c["token_ids"]) == (want_text, want_ids)
    assert c["finish_reason"] == "stop" and c["stop_reason"] == s
    assert c["logprobs"]["token_logprobs"] == full["logprobs"]["token_logprobs"][:len(want_ids)]
    # the engine request was aborted at the stop: its slot and pages are free
    wait_until(lambda: metrics(http, server.url).get(
        'tonp_requests_finished_total{reason="abort"}', 0) == finished + 1, what="the abort")
    after = metrics(http, server.url)
    assert after["tonp_num_requests_running"] == 0
    assert after["tonp_generation_tokens_total"] - made < 900
    # streamed: the same text (a possible stop prefix held back until it is decided)
    text, ids, reasons = "", [], []
    with http.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ch = httpx.Response(200, content=line[6:]).json()["choices"][0]
                text, ids = text + ch["text"], ids + ch["token_ids"]
                reasons.append(ch["finish_reason"])
    assert (text, ids, reasons[-1]) == (want_text, want_ids, "stop")


def test_stop_strings_cut_each_of_n_sampled_choices(oai, tok):
    model = tiny_model(torch.float32)
    p = prompts((8,), seed=45)[0].tolist()
    kw = dict(model=NAME, prompt=p, n=4, max_tokens=16, temperature=1.0, seed=11, logprobs=0,
              extra_body={"ignore_eos": True})
    free = oai.completions.create(**kw)
    texts = [c.text for c in free.choices]
    stops = sorted({t[2:4] for t in texts if len(t) >= 4 and t[2:4].isprintable()})[:2]
    assert stops, texts
    cut = oai.completions.create(stop=stops, **kw)
    hits = 0
    for f, c in zip(free.choices, cut.choices):
        cands = [_expected(tok, f.token_ids, s, False) + (s,) for s in stops]
        ids, text, s = min(cands, key=lambda x: (len(x[0]), len(x[1])))
        assert (c.token_ids, c.text) == (ids, text)
        if len(ids) < len(f.token_ids):
            hits += 1
            assert c.finish_reason == "stop" and c.stop_reason == s
        assert_bitwise(f32(c.logprobs.token_logprobs), lps(model, p + ids)[len(p) - 1:])
    assert hits >= 1


def test_chat_stop_strings_and_vllms_response_fields(oai, tok):
    r = oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=12, temperature=0, logprobs=True,
                                    top_logprobs=0, extra_body=dict(
                                        ignore_eos=True, return_token_ids=True,
                                        return_tokens_as_token_ids=True))
    c = r.choices[0]
    assert r.prompt_token_ids[-3:] == tok("<|im_start|>assistant\n")["input_ids"][-3:]
    assert [t.token for t in c.logprobs.content] == [f"token_id:{t}" for t in c.token_ids]
    text = c.message.content
    s = next(text[j:j + 2] for j in range(1, len(text) - 1)
             if text[j:j + 2].isascii() and text[j:j + 2].isprintable())
    c2 = oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=12, temperature=0, stop=s,
                                     extra_body={"ignore_eos": True}).choices[0]
    assert c2.message.content == text[:text.index(s)] and c2.finish_reason == "stop"


# -- metadata, cache, bounds ----------------------------------------------------------------------
def test_vllm_metadata_and_reset_prefix_cache(http, server):
    u = server.url
    assert http.get(f"{u}/get_world_size").json() == {"world_size": 1}
    assert http.get(f"{u}/server_info").json()["vllm_config"]["model_config"]["model"] == NAME
    assert "version" in http.get(f"{u}/version").json()
    p = prompts((40,), seed=46)[0].tolist()
    http.post(f"{u}/v1/completions", json={"prompt": p, "max_tokens": 1})
    assert metrics(http, u)["tonp_prefix_cache_pages"] > 0
    assert http.post(f"{u}/reset_prefix_cache").json()["success"] is True
    assert metrics(http, u)["tonp_prefix_cache_pages"] == 0
    again = http.post(f"{u}/v1/completions", json={"prompt": p, "max_tokens": 1}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


BOUNDS = [  # (body, param, words)
    ({"prompt": "x" * (MAX_CHARS + 1)}, "prompt", "over the server's limit of 3000"),
    ({"prompt": ["x", "y" * (MAX_CHARS + 1)]}, "prompt", "prompt 1 has 3001 characters"),
    ({"prompt": [1, 2], "logprobs": 9}, "logprobs", "logprobs must be at most 8"),
    ({"prompt": [1, 2], "prompt_logprobs": 9}, "prompt_logprobs", "--max-logprobs"),
    ({"prompt": [1, 2], "prompt_logprobs": -1}, "prompt_logprobs", "must be >= 0"),
    ({"prompt": [1, 2], "stop": [""]}, "stop", "non-empty"),
    ({"prompt": [1, 2], "stop": ["a"] * 65}, "stop", "at most 64"),
    ({"prompt": [1, 2], "prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "stream"),
    ({"prompt": [1, 2], "echo": True, "stream": True}, "echo", "stream"),
    ({"prompt": [1, 2], "seed": 2**64}, "seed", "seed must be"),
    ({"prompt": [1, 2], "n": 0}, "n", "n must be >= 1"),
]


@pytest.mark.parametrize("body, param, words", BOUNDS, ids=[b[1] + ":" + b[2][:20] for b in BOUNDS])
def test_the_door_checks_every_bound_before_queueing(http, server, body, param, words):
    r = http.post(f"{server.url}/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_the_chat_door_bounds_the_messages_before_the_template(http, server):
    r = http.post(f"{server.url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "z" * (MAX_CHARS + 1)}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


# -- TRL's client, unchanged ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def trl_client(server, monkeypatch_module):
    from trl.generation import vllm_client as vc
    # VLLMClient refuses to start without the vllm package; its HTTP calls do not need it.
    monkeypatch_module.setattr(vc, "is_vllm_available", lambda *a, **k: True)
    return vc.VLLMClient(base_url=server.url, connection_timeout=30)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_trls_vllm_client_generates_scores_and_resets_the_cache(trl_client):
    model = tiny_model(torch.float32)
    ps = [p.tolist() for p in prompts((9, 14), seed=47)]
    out = trl_client.generate(ps, n=2, max_tokens=5, temperature=1.0,
                              generation_kwargs={"seed": 5, "ignore_eos": True})
    assert out["prompt_ids"] == ps and len(out["completion_ids"]) == 4
    for i, ids in enumerate(out["completion_ids"]):
        p = ps[i // 2]
        assert [row[0] for row in out["logprob_token_ids"][i]] == ids
        got = f32([row[0] for row in out["logprobs"][i]])
        assert_bitwise(got, lps(model, p + ids)[len(p) - 1:], f"sequence {i}")
    seqs = [p + ids for p, ids in zip(ps, out["completion_ids"][::2])]
    scored = trl_client.get_sequence_logprobs(seqs, [len(p) for p in ps], top_logprobs=4)
    for s, p, actual, top in zip(seqs, ps, scored["actual_logprobs"], scored["logprobs"]):
        assert_bitwise(f32([a[0] for a in actual]), lps(model, s)[len(p) - 1:])
        assert all(len(t) == 4 and t == sorted(t, reverse=True) for t in top)
    chat = trl_client.chat([[{"role": "user", "content": "hi"}]], max_tokens=3,
                           generation_kwargs={"ignore_eos": True})
    assert len(chat["completion_ids"][0]) == 3 and chat["prompt_ids"][0]
    assert trl_client.get_world_size() == 1
    trl_client.reset_prefix_cache()
    assert "model_config" in trl_client.get_server_info()


# -- the text side, without a server ----------------------------------------------------------
def test_incremental_text_equals_the_full_decode_and_stops_like_vllm(ckpt):
    import random

    from tonp_models.serve.text import Detokenizer, StopText, TextCodec
    codec = TextCodec(ckpt)
    pieces = codec.encode("héllo wörld 日本 ok", "text") + list(range(256, 259))
    rng = random.Random(0)
    for _ in range(200):    # byte tokens: multi-byte characters span tokens; invalid bytes too
        ids = [rng.choice([rng.randrange(259), rng.choice(pieces)]) for _ in range(30)]
        for skip in (False, True):
            d = Detokenizer(codec, skip)
            out = "".join(d.add([t], final=i == len(ids) - 1) for i, t in enumerate(ids))
            assert out == codec.decode(ids, skip), ids
    ids = codec.encode("say 日本 then stop", "text")
    for include, want in ((False, "say "), (True, "say 日本")):
        st = StopText(codec, ["日本", "then"], include)
        hits = [st.add([t]) for t in ids]
        done = hits.index("日本")            # the token completing the character completes it
        assert codec.decode(ids[:done + 1]).endswith("日本") and hits[done - 1] is None
        assert st.text == want and st.visible(False) == want
    held = StopText(codec, ["stop"])
    for t in codec.encode("go st", "text"):
        held.add([t])
    assert held.text == "go st" and held.visible(False) == "go" and held.visible(True) == "go st"
