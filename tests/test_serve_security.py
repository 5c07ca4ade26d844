"""The rollout service left running on a machine with a browser and other users, against `python -m
tonp_models.serve` on a free loopback port, through raw sockets, httpx, the official `openai`
client and RolloutClient:

* a cross-site `text/plain` (or form) POST, which a browser sends without a CORS preflight,
  cannot drive /update_weights: 415, nothing loaded; the same body as JSON loads;
* a Host header other than localhost / 127.0.0.1 / [::1] (DNS rebinding) is a 421, a browser
  Origin of another site a 403 on every state-changing route;
* with --api-key every route but /health needs `Authorization: Bearer KEY` (401 otherwise, an
  OpenAI-style body); the openai client and RolloutClient with the key work;
* a body over --max-body-bytes is a 413 before it is read (Content-Length) or once the count
  passes the limit (chunked): a 50 MB body no longer grows the server by its size;
* a client that disconnects while sending its body is one log line, not an ASGI traceback;
* a 500 body says only "internal server error (see the server log, id X)", the log has X and
  the details; 4xx and the service's 503 keep their own messages.
"""
from __future__ import annotations

import asyncio
import copy
import json
import logging
import re
import socket
import threading
import time

import httpx
import openai
import pytest
import torch

from serve_utils import ServerProcess, metrics, module_server, tiny_checkpoint, wait_until
from test_generation import tiny_model
from tonp_models.serve import RolloutClient
from tonp_models.serve.client import ServerError
from tonp_models.serve.cli import parse_args
from tonp_models.serve.security import Guard, Security, default_body_limit, hostname


PRESET = ["--preset", "tiny", "--set", "num_hidden_layers=2", "--set", "mlp_only_layers=[1]",
          "--max-model-len", "512"]
GENERIC = re.compile(r"^internal server error \(see the server log, id ([0-9a-f]{12})\)$")
COMPLETION = {"prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True}


def _two_copies(d):
    """A checkpoint, and inside it (where the server may load weights from) a second copy."""
    tiny_checkpoint(d, tokenizer=False)
    tiny_checkpoint(d / "v2", tokenizer=False)
    return d


ckpt, server, http, _ = module_server(["--dtype", "fp32", "--max-model-len", "512"],
                                      make_ckpt=_two_copies, http_timeout=30)


def _version(http, url) -> int:
    r = http.get(url + "/health")
    assert r.status_code == 200, r.text
    return r.json()["weight_version"]


def _addr(url: str):
    host, port = url.split("//")[1].split(":")
    return host, int(port)


def _raw(url: str, head: str, body: bytes = b"", timeout: float = 10.0) -> bytes:
    """One request written by hand (`head`: request line and headers); the response bytes."""
    with socket.create_connection(_addr(url), timeout=timeout) as s:
        s.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        return _response(s)


def _response(s: socket.socket) -> bytes:
    """The bytes read from `s` until a JSON response is whole (or the server closes)."""
    out = b""
    while not (b"\r\n\r\n" in out and out.rstrip().endswith(b"}")):
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        out += chunk
    return out


def _status_and_json(resp: bytes):
    head, _, body = resp.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body), head.decode().lower()


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(x for x in f if x.startswith("VmRSS")).split()[1])


# -- JSON bodies only --------------------------------------------------------------------------
def test_a_cross_site_text_plain_post_cannot_drive_update_weights(server, http, ckpt):
    """The probe's attack: a page on any site POSTs text/plain (no preflight) with a JSON body
    to /update_weights. Refused with 415 and nothing loaded; the same body as JSON loads."""
    url, body = server.url, json.dumps({"model_path": str(ckpt / "v2")})
    before = _version(http, url)
    for ctype in ("text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                  "multipart/form-data; boundary=x"):
        r = http.post(url + "/update_weights", content=body, headers={"Content-Type": ctype})
        assert r.status_code == 415, r.text
        assert "Content-Type: application/json" in r.json()["error"]["message"]
    r = http.post(url + "/update_weights", content=body)    # no Content-Type at all
    assert r.status_code == 415 and "no Content-Type" in r.json()["error"]["message"], r.text
    r = http.post(url + "/v1/completions", content=json.dumps(COMPLETION),
                  headers={"Content-Type": "text/plain"})
    assert r.status_code == 415, r.text
    assert _version(http, url) == before                    # nothing was loaded
    for h in ({}, {"Content-Type": "application/x-www-form-urlencoded"}):   # an empty body
        r = http.post(url + "/update_weights", headers=h)  # (requests' / urllib's body-less POST)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("body:"), r.text
    r = http.post(url + "/update_weights", content=body,
                  headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert _version(http, url) == before + 1


# -- Host and Origin ---------------------------------------------------------------------------
def test_a_host_other_than_loopback_is_refused(server, http):
    """DNS rebinding: a page at attacker.example whose name now resolves to 127.0.0.1 sends
    Host: attacker.example:PORT (and its Origin). Every route refuses it with 421."""
    port = _addr(server.url)[1]
    for host in (f"attacker.example:{port}", "attacker.example", f"10.1.2.3:{port}", ""):
        for method, path in (("GET", "/health"), ("GET", "/v1/models"),
                             ("POST", "/v1/completions")):
            r = http.request(method, server.url + path, json=COMPLETION if method == "POST" else
                             None, headers={"Host": host, "Origin": f"http://{host}"})
            assert r.status_code == 421, (host, path, r.text)
            assert "--allowed-host" in r.json()["error"]["message"]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST:1234"):
        r = http.post(server.url + "/v1/completions", json=COMPLETION, headers={"Host": host})
        assert r.status_code == 200, (host, r.text)


def test_a_browser_origin_of_another_site_is_refused_on_state_changing_routes(server, http, ckpt):
    before = _version(http, server.url)
    for origin in ("https://evil.example", "http://127.0.0.1.evil.example:8000", "null"):
        for path, body in (("/update_weights", {"model_path": str(ckpt / "v2")}),
                           ("/v1/completions", COMPLETION), ("/generate", {"input_ids": [1]})):
            r = http.post(server.url + path, json=body, headers={"Origin": origin})
            assert r.status_code == 403, (origin, path, r.text)
            assert "cross-site" in r.json()["error"]["message"]
    assert _version(http, server.url) == before
    # a GET's answer is not readable by another site (no CORS headers), so it is not refused
    assert http.get(server.url + "/v1/models", headers={"Origin": "https://evil.example"}
                    ).status_code == 200
    r = http.post(server.url + "/v1/completions", json=COMPLETION,
                  headers={"Origin": "http://localhost:3000"})
    assert r.status_code == 200, r.text


# -- weight-update groups -----------------------------------------------------------------------
def test_a_weight_update_group_elsewhere_than_loopback_is_refused(server, http):
    """/init_weights_update_group makes every server rank connect to master_address: bound to
    loopback, the server refuses any other address (400 naming the field) before connecting."""
    before = _version(http, server.url)
    for addr in ("10.1.2.3", "attacker.example", "0.0.0.0", "[2001:db8::1]"):
        t0 = time.monotonic()
        r = http.post(server.url + "/init_weights_update_group", json={
            "master_address": addr, "master_port": 29500, "rank_offset": 1, "world_size": 2,
            "backend": "gloo"})
        assert r.status_code == 400, (addr, r.text)
        err = r.json()["error"]
        assert err["param"] == "master_address" and "--allowed-master-address" in err["message"]
        assert time.monotonic() - t0 < 5, "refused at the door, not after a connection attempt"
    assert _version(http, server.url) == before
    r = http.post(server.url + "/v1/completions", json=COMPLETION)
    assert r.status_code == 200, r.text


def test_the_weight_sync_addresses_of_a_bind_address():
    def ok(policy, *addrs):
        return [policy.sync_address_ok(a) for a in addrs]
    lo = Security.for_server("127.0.0.1", max_body_bytes=1)
    assert ok(lo, "127.0.0.1", "127.0.0.5", "localhost", "::1", "[::1]") == [True] * 5
    assert ok(lo, "10.1.2.3", "trainer.example", "0.0.0.0") == [False] * 3
    named = Security.for_server("127.0.0.1", allowed_hosts=["Trainer.Example"], max_body_bytes=1)
    assert ok(named, "trainer.example", "10.1.2.3") == [True, False]
    args = parse_args(["--preset", "tiny", "--allowed-master-address", "10.1.2.3"])
    flag = Security.for_server("127.0.0.1", master_addresses=args.allowed_master_address,
                               max_body_bytes=1)
    assert ok(flag, "10.1.2.3", "10.1.2.4", "trainer.example") == [True, False, False]
    star = Security.for_server("::1", master_addresses=["*"], max_body_bytes=1)
    assert ok(star, "10.1.2.3", "trainer.example") == [True, True]
    wide = Security.for_server("0.0.0.0", api_keys=["k"], max_body_bytes=1)
    assert ok(wide, "10.1.2.3", "trainer.example") == [True, True]
    wide_named = Security.for_server("0.0.0.0", api_keys=["k"], master_addresses=["10.0.0.1"],
                                     max_body_bytes=1)
    assert ok(wide_named, "10.0.0.1", "10.0.0.2", "127.0.0.1") == [True, False, True]


# -- body size and disconnects -----------------------------------------------------------------
def test_a_body_over_the_limit_is_refused_before_it_is_read(server, http):
    """Content-Length 50 MB, body never sent: 413 at once. A chunked 50 MB body (no length):
    413 once the count passes the limit, and the server's memory does not grow by its size."""
    host, port = _addr(server.url)
    limit = default_body_limit(512)
    resp = _raw(server.url, f"POST /v1/completions HTTP/1.1\nHost: 127.0.0.1:{port}\n"
                            f"Content-Type: application/json\nContent-Length: 50000000\n")
    status, body, head = _status_and_json(resp)
    assert status == 413 and f"limit of {limit} bytes" in body["error"]["message"], resp
    assert "connection: close" in head

    rss = _rss_kb(server.proc.pid)
    mb = b" " * (1 << 20)
    with socket.create_connection((host, port), timeout=20) as s:
        def upload():
            try:
                s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                          f"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
                          f"\r\n".encode())
                for _ in range(50):
                    s.sendall(b"100000\r\n" + mb + b"\r\n")
                s.sendall(b"0\r\n\r\n")
            except OSError:     # the server answered and closed: the rest is not wanted
                pass
        t = threading.Thread(target=upload)
        t.start()
        resp = _response(s)
        t.join(20)
    status, body, _ = _status_and_json(resp)
    assert status == 413 and "exceeds the server's limit" in body["error"]["message"], body
    grown = _rss_kb(server.proc.pid) - rss
    assert grown < 25_000, f"the server grew by {grown} kB reading a refused 50 MB body"
    # just under the limit is served
    padded = json.dumps(COMPLETION).encode()[:-1] + b" " * (limit - 200) + b"}"
    r = http.post(server.url + "/v1/completions", content=padded,
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text


def test_a_client_that_disconnects_during_the_upload_is_one_log_line(server, http):
    port = _addr(server.url)[1]
    seen = len(server.output)
    with socket.create_connection(_addr(server.url), timeout=10) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: "
                  f"application/json\r\nContent-Length: 1000\r\n\r\n{{\"prompt\": [1,".encode())
        time.sleep(0.2)
    wait_until(lambda: any("disconnected while sending the body" in x
                           for x in server.output[seen:]), 10, "the disconnect logged")
    assert http.post(server.url + "/v1/completions", json=COMPLETION).status_code == 200
    time.sleep(0.3)
    new = "".join(server.output[seen:])
    assert "Traceback" not in new and "Exception in ASGI" not in new, new
    assert sum("disconnected" in x for x in server.output[seen:]) == 1, new


# -- API key -----------------------------------------------------------------------------------
def test_an_api_key_guards_every_route_but_health(tmp_path):
    with ServerProcess(PRESET + ["--api-key", "k-one", "--api-key", "k-two"]) as srv, \
            httpx.Client(timeout=30) as c:
        url = srv.url
        assert c.get(url + "/health").status_code == 200          # probes need no key
        for auth in (None, "Bearer wrong", "Bearer k-one-", "Basic k-one", "k-one", "Bearer"):
            h = {} if auth is None else {"Authorization": auth}
            for method, path in (("GET", "/v1/models"), ("GET", "/metrics"),
                                 ("POST", "/v1/completions"), ("POST", "/generate"),
                                 ("POST", "/update_weights")):
                r = c.request(method, url + path, headers=h,
                              json={"model_path": str(tmp_path)} if "update" in path else
                              COMPLETION if method == "POST" else None)
                assert r.status_code == 401, (auth, path, r.text)
                err = r.json()["error"]
                assert err["code"] == 401 and "Authorization: Bearer" in err["message"], err
                assert r.headers["www-authenticate"] == "Bearer"
        for key in ("k-one", "k-two"):
            ok = openai.OpenAI(base_url=url + "/v1", api_key=key, timeout=30, max_retries=0)
            assert [m.id for m in ok.models.list().data] == ["tiny"]
            out = ok.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=3,
                                        extra_body={"ignore_eos": True})
            assert len(out.choices[0].token_ids) == 3
        bad = openai.OpenAI(base_url=url + "/v1", api_key="k-three", timeout=30, max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="wrong API key"):
            bad.completions.create(model="tiny", prompt=[1, 2], max_tokens=1)
        got = RolloutClient(url, api_key="k-two").generate([[1, 2, 3]], 2, seed=1)
        assert got.sequences[0].shape == (5,)
        with pytest.raises(ServerError) as e:
            RolloutClient(url, api_key="").generate([[1, 2, 3]], 2)
        assert e.value.status == 401
        assert c.get(url + "/metrics", headers={"Authorization": "bearer k-one"}
                     ).status_code == 200                        # the scheme is case-blind
        assert "k-one" not in srv.log and "k-two" not in srv.log


def test_the_api_key_comes_from_the_flag_else_tonp_api_key(monkeypatch, capsys):
    monkeypatch.delenv("TONP_API_KEY", raising=False)
    assert parse_args(["--preset", "tiny"]).api_key is None
    monkeypatch.setenv("TONP_API_KEY", "from-env")
    assert parse_args(["--preset", "tiny"]).api_key == ["from-env"]
    assert parse_args(["--preset", "tiny", "--api-key", "flag"]).api_key == ["flag"]
    for bad in (["--api-key", " "], ["--max-body-bytes", "0"]):
        with pytest.raises(SystemExit):
            parse_args(["--preset", "tiny", *bad])
    monkeypatch.setenv("TONP_API_KEY", "")
    with pytest.raises(SystemExit):
        parse_args(["--preset", "tiny"])
    assert "empty key" in capsys.readouterr().err


def test_the_policy_of_a_bind_address(caplog):
    lo = Security.for_server("127.0.0.1", max_body_bytes=10)
    assert lo.hosts == lo.origins == {"localhost", "127.0.0.1", "::1"} and not lo.api_keys
    assert Security.for_server("::1", max_body_bytes=10).hosts == lo.hosts
    with caplog.at_level(logging.WARNING, logger="uvicorn.error"):
        wide = Security.for_server("0.0.0.0", api_keys=["k"], max_body_bytes=10)
        assert not caplog.records
        named = Security.for_server("0.0.0.0", allowed_hosts=["Box.Example:8000"],
                                    max_body_bytes=1)
    assert "without --api-key" in caplog.records[0].getMessage()   # the open bind is flagged
    assert wide.hosts is None and wide.origins == lo.hosts   # any Host; browsers still checked
    assert named.hosts == lo.hosts | {"box.example"}
    star = Security.for_server("127.0.0.1", allowed_hosts=["*"], max_body_bytes=1)
    assert star.hosts is None and star.origins is None
    assert [hostname(h) for h in ("[::1]:80", "LocalHost.", "a.b:1", "::1")] == \
        ["::1", "localhost", "a.b", "::1"]
    assert default_body_limit(512) == 4 << 20 and default_body_limit(1 << 20) == 64 << 20
    with pytest.raises(ValueError, match="empty key"):
        Security.for_server("127.0.0.1", api_keys=[""], max_body_bytes=1)


# -- 500 bodies --------------------------------------------------------------------------------
def test_a_server_fault_answers_a_generic_500_and_logs_the_details(tmp_path):
    """A checkpoint whose finite weights overflow fp32 in the forward: every request ends with
    the engine's 'logits are not finite' error, a server fault. Whole and streamed, the client
    gets only the generic message and an id; the server log has the id and the details. A 4xx
    keeps its own message."""
    model = copy.deepcopy(tiny_model(torch.float32))
    with torch.no_grad():
        model.lm_head.weight.fill_(3e38)
        model.norm.weight.fill_(1e5)
    ckpt = tiny_checkpoint(tmp_path / "huge", model, tokenizer=False)
    with ServerProcess(["--hf", ckpt, "--dtype", "fp32", "--max-model-len", "512"]) as srv, \
            httpx.Client(timeout=30) as c:
        r = c.post(srv.url + "/v1/completions", json=COMPLETION)
        assert r.status_code == 500, r.text
        ident = GENERIC.match(r.json()["error"]["message"]).group(1)
        with c.stream("POST", srv.url + "/generate",
                      json={"input_ids": [1, 2], "stream": True}) as s:
            events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
        assert events[-1]["error"]["code"] == 500, events
        streamed = GENERIC.match(events[-1]["error"]["message"]).group(1)
        r = c.post(srv.url + "/v1/completions", json={"prompt": [1, 9999]})
        assert r.status_code == 400 and "outside the vocabulary" in r.text, r.text
        wait_until(lambda: streamed in srv.log, 10, "the streamed fault logged")
        for i in (ident, streamed):
            line = next(x for x in srv.output if i in x)
            assert "not finite" in line, line


def test_the_services_503_keeps_its_own_words(tmp_path):
    """A whole response cancelled by a shutdown: 503 with the service's message, no id."""
    args = PRESET + ["--num-pages", "64", "--max-batch-size", "16", "--graceful-timeout", "0.3"]
    with ServerProcess(args) as srv, httpx.Client(timeout=60) as c:
        got = []
        t = threading.Thread(target=lambda: got.append(c.post(srv.url + "/v1/completions", json={
            "prompt": [1, 2], "max_tokens": 500, "n": 8, "ignore_eos": True})))
        t.start()
        wait_until(lambda: metrics(c, srv.url)["tonp_num_requests_running"] > 0, 20, "running")
        srv.proc.send_signal(15)
        t.join(30)
        assert srv.proc.wait(30) == 0, srv.log
    r = got[0]
    assert r.status_code == 503, r.text
    assert r.json()["error"]["message"] == "the server is shutting down: the request was " \
                                           "cancelled"
    assert "internal error" not in srv.log, srv.log


def test_guard_turns_an_unexpected_exception_into_a_generic_500(caplog):
    """The seam itself, in process: an app that raises with a path in its message."""
    async def app(scope, receive, send):
        assert scope["type"] == "http"
        await receive()
        raise KeyError("/secret/dir/weights.safetensors")

    async def call():
        guarded = Guard(app, Security(max_body_bytes=100))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guarded),
                                     base_url="http://127.0.0.1:8000") as c:
            return await c.post("/x", json={"a": 1})
    with caplog.at_level(logging.ERROR, logger="uvicorn.error"):
        r = asyncio.run(call())
    assert r.status_code == 500
    msg = r.json()["error"]["message"]
    assert "secret" not in r.text and "KeyError" not in r.text
    ident = GENERIC.match(msg).group(1)
    rec = next(x for x in caplog.records if ident in x.getMessage())
    assert "KeyError" in rec.getMessage() and "/secret/dir" in rec.getMessage()
    assert rec.exc_info is not None                               # the traceback is logged
