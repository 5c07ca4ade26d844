"""Weight updates of a running server (a tiny checkpoint served on a free loopback port):

* a refused update changes nothing: a file, a directory without safetensors, a path outside
  --allowed-weights-dir (also through a symlink or ".."), a half-written directory, a tensor of
  the wrong shape, a missing tensor: each a 4xx naming the path and the problem (never what the
  files hold), the server healthy, and a request queued behind it served by the old weights
  under the old weight_version;
* an update that fails part-way (a corrupted tensor found while copying) fails the request
  queued behind it, /health is 503 and generation refused until a good update; a refused
  update is still a 4xx then;
* a trainer process pushes weights over a gloo group (SGLang's /init_weights_update_group +
  /update_weights_from_distributed): the served logprobs are then, bit for bit, the training
  forward's under the new weights and a server started from them on disk; a request in flight
  finishes under one weight version; bad metadata is refused with nothing changed; a TP=2 and
  an EP=2 server take the push on both ranks;
* a step that raises (a request whose noise key overflows int64) fails that request only.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import assert_bitwise
from dist_utils import free_port
from serve_utils import ServerProcess, metrics, module_server, rank_env, tiny_checkpoint, \
    wait_until
from test_generation import prompts, tiny_model
from tonp_models.qwen3_moe.checkpoint import state_dict_hub
from tonp_models.serve.weight_sync import WeightSender

ARGS = ["--dtype", "fp32", "--max-batch-size", "8", "--max-step-tokens", "24"]
P = prompts((12,), seed=31)[0].tolist()


# the server may load weights from <base>/allowed (its checkpoint's directory), not from elsewhere
ckpt, server, http, _ = module_server(
    [*ARGS, "--weight-sync-timeout", "5"],
    make_ckpt=lambda base: tiny_checkpoint(base / "allowed" / "ckpt", tokenizer=False),
    extra=lambda path: ["--allowed-weights-dir", os.path.dirname(path)])


@pytest.fixture(scope="module")
def dirs(ckpt):
    """<base>: `allowed` (the server's --allowed-weights-dir) and the places outside it."""
    return Path(ckpt).parents[1]


@pytest.fixture(scope="module")
def new_model():
    old = tiny_model(torch.float32)
    torch.manual_seed(7)
    new = type(old)(old.config).eval()
    with torch.no_grad():
        new.lm_head.weight.mul_(10.0)
    return new




def score(model, prompt, completion):
    with torch.no_grad():
        lp = model.token_logprobs([torch.tensor(list(prompt) + list(completion))])[0]
    return lp[len(prompt) - 1:]


def gen(http, url, n=6):
    """(status, token ids, logprobs, weight_version) of a greedy /generate of P."""
    sp = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    r = http.post(f"{url}/generate", json={"input_ids": P, "return_logprob": True,
                                           "sampling_params": sp})
    if r.status_code != 200:
        return r.status_code, None, None, None
    m = r.json()["meta_info"]
    return 200, r.json()["output_ids"], torch.tensor([x[0] for x in m["output_token_logprobs"]]
                                                     ), m["weight_version"]


def update(http, url, path, **kw):
    return http.post(f"{url}/update_weights", json={"model_path": str(path), **kw})


def version(http, url):
    return http.get(f"{url}/health").json()["weight_version"]


def _checkpoint_variant(dirs, name, ckpt, edit):
    """A copy of ckpt in allowed/<name> whose tensors went through edit(dict)."""
    d = dirs / "allowed" / name
    d.mkdir()
    with open(os.path.join(ckpt, "config.json")) as f:
        (d / "config.json").write_text(f.read())
    tensors = load_file(os.path.join(ckpt, "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def _refused_cases(dirs, ckpt, new_model):
    a, out = dirs / "allowed", dirs / "outside"
    out.mkdir(exist_ok=True)
    outside = tiny_checkpoint(out / "ckpt", new_model, tokenizer=False)
    (a / "plain").mkdir()
    (a / "plain" / "config.json").write_text('{"SECRET_KEY_NAME": 1}')
    (a / "json").mkdir()
    (a / "json" / "config.json").write_text('{"SECRET_KEY_NAME": "SECRET_VALUE"}')
    (a / "json" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00SECRETBYTES")
    (a / "half").mkdir()
    raw = open(os.path.join(ckpt, "model.safetensors"), "rb").read()
    (a / "half" / "config.json").write_text(open(os.path.join(ckpt, "config.json")).read())
    (a / "half" / "model.safetensors").write_bytes(raw[:len(raw) // 2])   # a half-written save
    os.symlink(outside, a / "link")
    name = "model.layers.0.self_attn.q_proj.weight"
    return [  # (id, path, status, words in the message)
        ("file", os.path.join(ckpt, "model.safetensors"), 400, "is not a checkpoint directory"),
        ("no safetensors", a / "plain", 400, "no config.json and *.safetensors"),
        ("outside", outside, 403, "outside the directory"),
        ("symlink out", a / "link", 403, "outside the directory"),
        ("dotdot", f"{a}/../outside/ckpt", 403, "outside the directory"),
        ("foreign json", a / "json", 400, "cannot read a checkpoint config"),
        ("half-written", a / "half", 400, "cannot be read"),
        ("wrong shape", _checkpoint_variant(dirs, "shape", ckpt, lambda t: t.update(
            {name: t[name][:-1].clone()})), 400, "1 mis-shaped"),
        ("missing tensor", _checkpoint_variant(dirs, "missing", ckpt, lambda t: t.pop(name)),
         400, "1 missing"),
    ]


def test_refused_updates_change_nothing(server, http, ckpt, dirs, new_model):
    _, ids, lps, v0 = gen(http, server.url)
    for case, path, status, words in _refused_cases(dirs, ckpt, new_model):
        r = update(http, server.url, path)
        msg = r.json()["message"]
        assert r.status_code == status and words in msg and not r.json()["success"], (case, msg)
        assert "SECRET" not in msg, (case, msg)                 # never what a file holds
        assert http.get(f"{server.url}/health").json() == {"status": "ok", "weight_version": v0}
        s, ids2, lps2, v = gen(http, server.url)
        assert s == 200 and ids2 == ids and v == v0, case
        assert_bitwise(lps2, lps, f"after the refused {case} update")


class _Behind:
    """A long greedy stream running, then an update of `path` (drains behind the stream),
    then a /generate queued behind the update (held: it waits until the update ran)."""

    def __init__(self, http, url, path):
        self.out, first = {}, threading.Event()

        def stream():
            body = {"input_ids": P, "stream": True, "sampling_params": {
                "max_new_tokens": 900, "temperature": 0, "ignore_eos": True}}
            with httpx.stream("POST", f"{url}/generate", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    first.set()
            self.out["stream"] = True

        def run(key, fn):
            self.out[key] = fn()
        self.threads = [threading.Thread(target=stream)]
        self.threads[0].start()
        assert first.wait(30)
        self.threads.append(threading.Thread(target=run, args=(
            "update", lambda: update(httpx.Client(timeout=120), url, path))))
        self.threads[-1].start()
        time.sleep(0.3)             # the update is queued: admission is held from here on
        self.threads.append(threading.Thread(target=run, args=(
            "queued", lambda: gen(httpx.Client(timeout=120), url))))
        self.threads[-1].start()
        wait_until(lambda: metrics(http, url)["tonp_num_requests_waiting"] >= 1, 20,
                   "the request queued behind the update")
        assert "update" not in self.out          # still draining behind the stream
        for t in self.threads:
            t.join(120)


def test_a_refused_update_serves_the_queued_request_with_the_old_weights(server, http, dirs,
                                                                          ckpt):
    _, ids, lps, v0 = gen(http, server.url)
    name = "model.layers.1.mlp.down_proj.weight"
    bad = _checkpoint_variant(dirs, "shape2", ckpt, lambda t: t.update({name: t[name].T.clone(
        ).contiguous()[:, :-1].clone()}))
    b = _Behind(http, server.url, bad)
    assert b.out["update"].status_code == 400, b.out["update"].text
    s, ids2, lps2, v = b.out["queued"]
    assert s == 200 and ids2 == ids and v == v0
    assert_bitwise(lps2, lps, "the request queued behind a refused update")


def test_an_update_failing_part_way_fails_the_queued_request_until_a_good_update(
        server, http, dirs, ckpt, new_model):
    _, ids, lps, v0 = gen(http, server.url)
    name = "model.norm.weight"
    corrupt = tiny_checkpoint(dirs / "allowed" / "corrupt", new_model, tokenizer=False)
    fn = os.path.join(corrupt, "model.safetensors")
    tensors = load_file(fn)
    tensors[name][3] = float("nan")                 # found only while copying: part-way
    save_file(tensors, fn, metadata={"format": "pt"})
    b = _Behind(http, server.url, corrupt)
    r = b.out["update"]
    assert r.status_code == 500 and "failed part-way" in r.json()["message"], r.text
    assert b.out["queued"][0] == 500                # never run on half-loaded weights
    assert http.get(f"{server.url}/health").status_code == 503
    assert gen(http, server.url)[0] == 503
    for path, status in ((os.path.join(ckpt, "model.safetensors"), 400),
                         (dirs / "outside" / "ckpt", 403)):   # refused: still a 4xx
        assert update(http, server.url, path).status_code == status
    r = update(http, server.url, ckpt, weight_version=v0 + 5)
    assert r.status_code == 200 and r.json()["weight_version"] == v0 + 5, r.text
    s, ids2, lps2, v = gen(http, server.url)
    assert s == 200 and ids2 == ids and v == v0 + 5
    assert_bitwise(lps2, lps, "after the good update")


# ---------------------------------------------------------------------------------------------
# Distributed (the trainer is this test process)
# ---------------------------------------------------------------------------------------------
def test_a_pushed_update_equals_a_fresh_load_and_bad_metadata_changes_nothing(
        server, http, ckpt, dirs, new_model):
    old = tiny_model(torch.float32)
    weights = state_dict_hub(new_model)
    v0 = version(http, server.url)
    stream, first = {"chunks": []}, threading.Event()

    def run_stream():
        body = {"input_ids": P, "stream": True, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 600, "temperature": 0,
                                    "ignore_eos": True}}
        with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    stream["chunks"].append(httpx.Response(200, content=line[6:]).json())
                    first.set()
    t = threading.Thread(target=run_stream)
    t.start()
    try:
        assert first.wait(30)
        with WeightSender(server.url, bucket_bytes=64 * 2**10, timeout_s=60) as sender:
            reply = sender.push(weights, weight_version=v0 + 10)     # several buckets
            assert reply["success"] and reply["weight_version"] == v0 + 10, reply
            t.join(120)
            # the request in flight ran under one weight version: the old weights'
            # SGLang's stream: every event holds the whole result so far
            last = stream["chunks"][-1]
            ids = last["output_ids"]
            got = [x[0] for x in last["meta_info"]["output_token_logprobs"]]
            assert len(ids) == 600
            assert {c["meta_info"]["weight_version"] for c in stream["chunks"]} == {v0}
            assert_bitwise(torch.tensor(got), score(old, P, ids), "in flight during the push")
            s, ids, lps, v = gen(http, server.url)
            assert s == 200 and v == v0 + 10
            assert_bitwise(lps, score(new_model, P, ids), "after the push vs the training forward")
            # bad metadata: refused, nothing changed, and the group still in step
            name = "model.norm.weight"
            for bad, words in (({"model.not_a_tensor": torch.zeros(3)}, "not a tensor of"),
                               ({**weights, name: torch.ones(5)}, f"{name}: pushed [5]")):
                with pytest.raises(RuntimeError, match="400") as e:
                    sender.push(bad)
                assert words in str(e.value)
                assert version(http, server.url) == v0 + 10
                s, ids2, lps2, _ = gen(http, server.url)
                assert ids2 == ids
                assert_bitwise(lps2, lps, "after a refused push")
        disk = tiny_checkpoint(dirs / "disk_new", new_model, tokenizer=False)
        with ServerProcess(["--hf", disk, *ARGS]) as fresh:
            _, ids3, lps3, _ = gen(http, fresh.url)
        assert ids3 == ids
        assert_bitwise(lps3, lps, "pushed vs a server started from the same weights on disk")
    finally:
        t.join(120)
        assert update(http, server.url, ckpt).status_code == 200


def test_a_rendezvous_that_cannot_complete_is_refused_and_the_server_serves_on(server, http):
    """The trainer counts 2 server ranks, the server has 1: the group never forms; both sides
    give up at their timeouts (3 s, 5 s), the server keeps its weights and serves. A second
    group under a name in use is refused and leaves the first one working."""
    before = gen(http, server.url)
    with pytest.raises(RuntimeError, match="init_weights_update_group"):
        WeightSender(server.url, server_ranks=2, timeout_s=3)
    assert http.get(f"{server.url}/health").json()["status"] == "ok"
    after = gen(http, server.url)
    assert after[1] == before[1]
    assert_bitwise(after[2], before[2], "after a failed rendezvous")
    # a second group of the same name is refused; the first one still works
    with WeightSender(server.url, timeout_s=3) as sender:
        with pytest.raises(RuntimeError, match="exists"):
            WeightSender(server.url, timeout_s=3)
        v = version(http, server.url)
        assert sender.push(state_dict_hub(tiny_model(torch.float32)))["weight_version"] == v + 1
    again = gen(http, server.url)
    assert again[1] == before[1]
    assert_bitwise(again[2], before[2], "the same weights pushed again")


@pytest.mark.parametrize("layout", ["--tp", "--ep"], ids=["tp2", "ep2"])
def test_a_two_rank_server_takes_the_push_on_every_rank(ckpt, new_model, layout):
    """TP 2: each rank keeps its slices of every tensor; EP 2: its half of the experts (the
    other half is received and dropped)."""
    port, args = free_port(), ["--hf", ckpt, *ARGS, layout, "2"]
    with ServerProcess(args, env=rank_env(1, port, 2), announce=False) as follower, \
            ServerProcess(args, env=rank_env(0, port, 2)) as srv, \
            httpx.Client(timeout=60) as c:
        with WeightSender(srv.url, server_ranks=2, timeout_s=60) as sender:
            assert sender.push(state_dict_hub(new_model))["success"]
        s, ids, lps, v = gen(c, srv.url)
        assert s == 200 and v == 1
        assert_bitwise(lps, score(new_model, P, ids), f"{layout} 2 after the push")
        assert srv.stop() == 0, srv.log
        assert follower.proc.wait(30) == 0, follower.log


# ---------------------------------------------------------------------------------------------
# A request that breaks a step fails alone
# ---------------------------------------------------------------------------------------------
POISON = 7   # a token id whose step the _Poisoned model below breaks


class _Poisoned(torch.nn.Module):
    """The tiny model whose forward raises when a step feeds the token POISON: a request that
    breaks a step (the door checks every value it can; this is what they cannot foresee)."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config = model, model.config

    def new_cache(self, *a, **kw):
        return self.inner.new_cache(*a, **kw)

    def forward(self, input_ids, *a, **kw):
        if bool((input_ids == POISON).any()):
            raise RuntimeError("injected: this step fed the poisoned token")
        return self.inner(input_ids, *a, **kw)


def test_a_request_that_breaks_a_step_fails_alone_and_the_engine_serves_on():
    from tonp_models import generate
    from tonp_models.engine import Engine, Request, SamplingParams
    from tonp_models.serve.service import EngineService
    model = tiny_model(torch.float32)
    assert POISON not in P
    service = EngineService(Engine(_Poisoned(model), max_batch_size=4), lambda path: None)
    done, outs = threading.Event(), {}

    def sink(out):
        if out.finish:
            outs[out.request.key] = out.request
            if len(outs) == 2:
                done.set()
    service.start()
    try:
        service.submit([Request("bad", P + [POISON], SamplingParams(5, 1.0))], sink)
        wait_until(lambda: "bad" in outs, 30, "the bad request's end")
        service.submit([Request("good", P, SamplingParams(5, 1.0, seed=3), noise_key=1)], sink)
        assert done.wait(30)
    finally:
        service.shutdown()
    assert outs["bad"].finish == "error" and "step failed" in str(outs["bad"].error)
    assert service.healthy and outs["good"].finish == "length"
    ref = generate(model, [P], 5, temperature=1.0, seed=3, request_ids=[1])
    assert outs["good"].completion == ref.sequences[0][len(P):].tolist()
    assert_bitwise(torch.tensor(outs["good"].logprobs), ref.logprobs[0], "after the bad step")


def test_a_noise_key_past_the_bound_is_refused_at_the_door():
    """Noise keys >= 2**63 once overflowed the sampler's int64 ids inside engine.step and
    killed the engine thread; the request rules refuse them before they are queued."""
    from tonp_models.engine import Engine, Request, SamplingParams
    engine = Engine(tiny_model(torch.float32), max_batch_size=2)
    with pytest.raises(ValueError, match=r"noise_key must be in \[0, 9223372036854775808\)"):
        engine.add(Request("bad", P, SamplingParams(5, 1.0), noise_key=2**63))
    assert not engine.has_work


class _FailingForward(torch.nn.Module):
    """The tiny model whose forward raises (a fault no request causes)."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config = model, model.config

    def new_cache(self, *a, **kw):
        return self.inner.new_cache(*a, **kw)

    def forward(self, *a, **kw):
        raise RuntimeError("injected forward failure")


def test_a_step_failure_that_repeats_stops_the_engine_unhealthy():
    from tonp_models.engine import Engine, Request, SamplingParams
    from tonp_models.serve.service import EngineService
    service = EngineService(Engine(_FailingForward(tiny_model(torch.float32))), lambda p: None)
    ends = {}
    service.start()
    try:
        for key in ("first", "second"):
            service.submit([Request(key, P, SamplingParams(3))],
                           lambda out: ends.setdefault(out.request.key, out.finish))
            wait_until(lambda: key in ends, 30, f"the {key} request's end")
        wait_until(lambda: not service.healthy, 10, "the engine reported unhealthy")
    finally:
        service.shutdown()
    assert ends == {"first": "error", "second": "error"}
    assert "stopped" in service.error and "injected forward failure" in service.error
    with pytest.raises(RuntimeError, match="not running"):
        service.submit([Request("third", P, SamplingParams(3))], lambda out: None)
