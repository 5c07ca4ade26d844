"""The server's guards: one pure ASGI middleware, `Guard`, in front of every route (see
docs/serving.md, "Security"). In the order it checks, each refusal an OpenAI-style error body:

1. Host (421): when the policy names hosts (by default when bound to loopback: localhost,
   127.0.0.1, [::1]; any port), a request for another host name is refused: the DNS-rebinding
   defence (a page whose name resolves to 127.0.0.1 still sends its own name as Host).
2. API key (401): with keys, every route but GET /health needs `Authorization: Bearer KEY`
   (sha256 digests compared in constant time).
3. Origin (403): a browser's request from another site (an Origin header naming a host not
   allowed) is refused on every route that changes state (any method but GET, HEAD, OPTIONS).
4. Content-Type (415): such a request's body, unless empty, must be application/json, so the
   cross-site text/plain or form POST a browser sends without a CORS preflight never reaches a
   handler.
5. Body size (413): a Content-Length over the limit is refused before anything is read; a body
   without one is counted as it arrives and refused once over. The body (at most the limit) is
   read here and handed on whole; a client that disconnects mid-upload is one log line.
6. Errors: an exception the app did not turn into a response becomes a 500 whose body says
   "internal server error (see the server log, id X)"; the log has X and the traceback.

Beside the guard, `Security.sync_address_ok` is the rule /init_weights_update_group applies to
its master_address (weights_api.py): a server bound to loopback connects its ranks only to
loopback addresses, --allowed-host names and --allowed-master-address ones.
"""
from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import secrets
from dataclasses import dataclass
from typing import Dict, FrozenSet, Iterable, List, Optional, Tuple
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
OPEN_PATHS = frozenset({"/health"})       # reachable without the API key (GET only)
log = logging.getLogger("uvicorn.error")  # the server's log (uvicorn configures it)


def default_body_limit(context: int) -> int:
    """max(4 MiB, 64 bytes per context position): 8 full-context prompts as token-id JSON."""
    return max(4 << 20, 64 * context)


def hostname(value: str) -> str:
    """A Host header or host name without its port, lower-case, IPv6 unbracketed."""
    v = value.strip().lower()
    if v.startswith("["):
        return v[1:v.find("]")] if "]" in v else v
    if v.count(":") == 1:
        v = v.split(":")[0]
    return v.rstrip(".")


def is_loopback(host: str) -> bool:
    h = hostname(host)
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Security:
    """What `Guard` enforces.

    api_keys: sha256 digests of the accepted bearer tokens (none: no authentication).
    hosts: the host names a Host header may name (None: any).
    origins: the host names a browser Origin may name on a state-changing request (None: any).
    max_body_bytes: the largest request body.
    sync_hosts: the addresses besides loopback ones a weight-update group's master_address may
        name (None: any).
    """
    api_keys: Tuple[bytes, ...] = ()
    hosts: Optional[FrozenSet[str]] = LOOPBACK_HOSTS
    origins: Optional[FrozenSet[str]] = LOOPBACK_HOSTS
    max_body_bytes: int = 4 << 20
    sync_hosts: Optional[FrozenSet[str]] = frozenset()

    @classmethod
    def for_server(cls, bind_host: str, *, api_keys: Iterable[str] = (),
                   allowed_hosts: Iterable[str] = (), max_body_bytes: int,
                   master_addresses: Iterable[str] = ()) -> "Security":
        """The policy of a server bound to `bind_host`: the Host check when that is loopback or
        `allowed_hosts` are named ("*": any host, no Host nor Origin check); a weight-update
        group's master_address: loopback, `allowed_hosts` or `master_addresses` when bound to
        loopback or `master_addresses` are named ("*" in either: any)."""
        keys = list(api_keys)
        if any(not k.strip() for k in keys):
            raise ValueError("--api-key: an empty key would let everyone in")
        if max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes must be >= 1, got {max_body_bytes}")
        extra = frozenset(hostname(h) for h in allowed_hosts)
        names = None if "*" in extra else LOOPBACK_HOSTS | extra
        masters = frozenset(hostname(h) for h in master_addresses)
        loopback = is_loopback(bind_host)
        if not keys and not loopback:
            log.warning("tonp serve: bound to %s without --api-key: whoever reaches this port "
                        "can generate and load weights", bind_host)
        return cls(api_keys=tuple(_digest(k) for k in keys),
                   hosts=names if loopback or extra else None, origins=names,
                   max_body_bytes=max_body_bytes,
                   sync_hosts=None if "*" in extra | masters or not (loopback or masters)
                   else extra | masters)

    def sync_address_ok(self, address: str) -> bool:
        """May a weight-update group's store live at `address` (every server rank connects)?"""
        return self.sync_hosts is None or is_loopback(address) or \
            hostname(address) in self.sync_hosts

    def key_ok(self, authorization: Optional[str]) -> bool:
        scheme, _, token = (authorization or "").partition(" ")
        digest = _digest(token.strip())
        match = False
        for key in self.api_keys:        # no early exit: the time does not depend on which key
            match |= secrets.compare_digest(digest, key)
        return match and scheme.lower() == "bearer"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


# -- error bodies ------------------------------------------------------------------------------
def error_body(status: int, message: str, param: Optional[str] = None) -> Dict:
    """{"error": {"message", "type", "param", "code"}}, as OpenAI's API answers errors."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def incident(detail: str, where: str, exc: Optional[BaseException] = None) -> str:
    """Log a server fault (`detail`, and `exc`'s traceback) under a fresh id; the message a
    client gets instead: no exception type, path or file content."""
    ident = secrets.token_hex(6)
    log.error("internal error %s in %s: %s", ident, where, detail, exc_info=exc)
    return f"internal server error (see the server log, id {ident})"


def internal_error(scope, detail: str, exc: Optional[BaseException] = None) -> JSONResponse:
    """The 500 response to the request `scope` of a server fault, its details logged."""
    return JSONResponse(error_body(500, incident(detail, _where(scope), exc)), status_code=500)


def _where(scope) -> str:
    """"METHOD /path" for the log (escaped: a decoded path may hold a newline)."""
    return f"{scope['method']} {ascii(scope['path'])[1:-1]}"


def _quote(value: Optional[str]) -> str:
    """A client's header value as an error message quotes it: repr, at most 100 characters."""
    return repr(value if value is None or len(value) <= 100 else value[:100] + "...")


# -- the middleware ----------------------------------------------------------------------------
class _TooLarge(Exception):
    """The body grew past the limit while it was read."""


class Guard:
    """Pure ASGI middleware enforcing `policy` (the module docstring) on every HTTP request."""

    def __init__(self, app, policy: Security):
        self.app, self.policy = app, policy

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "websocket":    # no route takes one: refused before any check
            return await send({"type": "websocket.close", "code": 1008})
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        p, headers = self.policy, Headers(scope=scope)
        method, path, where = scope["method"], scope["path"], _where(scope)
        unsafe = method not in SAFE_METHODS
        declared = _content_length(headers)
        refusal = self._refusal(headers, method, path, unsafe, declared)
        if refusal is None and declared is not None and declared > p.max_body_bytes:
            refusal = _too_large(declared, p.max_body_bytes)
        if refusal is not None:   # a body left unread and over the limit: not worth draining
            return await _respond(send, *refusal, close=(declared or 0) > p.max_body_bytes)
        try:
            body = await _read_body(receive, p.max_body_bytes)
        except _TooLarge:
            return await _respond(send, *_too_large(None, p.max_body_bytes), close=True)
        if body is None:
            client = scope.get("client") or ("?", 0)
            log.warning("tonp serve: %s:%s disconnected while sending the body of %s "
                        "(Content-Length %s); nothing was run", *client[:2], where,
                        "none" if declared is None else declared)
            return None
        pending: List[Dict] = [{"type": "http.request", "body": body, "more_body": False}]

        async def replay():
            return pending.pop() if pending else await receive()

        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, replay, tracked)
        except Exception as e:  # noqa: BLE001 -- a fault of the server: logged, generic body
            message = incident(f"{type(e).__name__}: {e}", where, e)
            if not started:
                await _respond(send, 500, message)

    def _refusal(self, headers: Headers, method: str, path: str, unsafe: bool,
                 declared: Optional[int]) -> Optional[Tuple[int, str, Optional[str]]]:
        """(status, message, param) of the first check the request fails, or None."""
        p = self.policy
        host = headers.get("host")
        if p.hosts is not None and (host is None or hostname(host) not in p.hosts):
            return (421, f"this server does not answer for the host {_quote(host)}: it accepts "
                         f"{', '.join(sorted(p.hosts))} (add names with --allowed-host)", None)
        if p.api_keys and not (method == "GET" and path in OPEN_PATHS) \
                and not p.key_ok(headers.get("authorization")):
            return (401, "missing or wrong API key: send the header 'Authorization: Bearer "
                         "<key>' with the server's --api-key (or TONP_API_KEY)", None)
        if not unsafe:
            return None
        origin = headers.get("origin")
        if origin is not None and p.origins is not None and \
                _origin_host(origin) not in p.origins:
            return (403, f"cross-site requests are refused: the Origin {_quote(origin)} is not "
                         f"one of {', '.join(sorted(p.origins))} (add names with "
                         f"--allowed-host)", None)
        ctype = headers.get("content-type")
        has_body = bool(declared) or "transfer-encoding" in headers
        if has_body and (ctype or "").split(";")[0].strip().lower() != "application/json":
            return (415, f"the body must be JSON with the header 'Content-Type: "
                         f"application/json', got {_quote(ctype) if ctype else 'no Content-Type'}",
                    None)
        return None     # an empty body (a body-less route's POST) carries nothing to misread


def _origin_host(origin: str) -> Optional[str]:
    try:
        parts = urlsplit(origin.strip())
        return parts.hostname.rstrip(".") if parts.scheme in ("http", "https") and \
            parts.hostname else None
    except ValueError:
        return None


def _content_length(headers: Headers) -> Optional[int]:
    try:
        return int(headers["content-length"])
    except (KeyError, ValueError):
        return None


def _too_large(size: Optional[int], limit: int) -> Tuple[int, str, None]:
    has = "exceeds" if size is None else f"has {size} bytes (Content-Length), over"
    return (413, f"the request body {has} the server's limit of {limit} bytes "
                 f"(--max-body-bytes)", None)


async def _read_body(receive, limit: int) -> Optional[bytes]:
    """The whole body, or None if the client disconnected first; _TooLarge once over `limit`."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body += message.get("body", b"")
        if len(body) > limit:
            raise _TooLarge()
        if not message.get("more_body", False):
            return bytes(body)


async def _respond(send, status: int, message: str, param: Optional[str] = None,
                   close: bool = False) -> None:
    body = json.dumps(error_body(status, message, param)).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if close:   # the rest of the body is not read: the connection cannot be reused
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
