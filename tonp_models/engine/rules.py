"""A request's rules, in one place and one wording: its sampling values, its noise key, its
prompt (token ids in the vocabulary, positions within the context) and its fit in the KV cache.

    params = rules.sampling("generate", max_new_tokens=32, temperature=1.0, top_p=0.9, vocab=V)
    keys = rules.noise_keys("generate", request_ids, n)         # distinct, in [0, 2**63)
    rules.prompt("engine", "request a", tokens, 32, vocab=V, context=1024)
    rules.fits_cache("engine", "request a", positions, page_size=64, num_pages=16)

Every entry point makes its requests through these: `generate`, `Engine.check` / `add` and the
HTTP service (whose 400 names `err.field`, the argument each error is about). A rule raises
TypeError for a wrong type, ValueError / IndexError for a wrong value, CacheFullError for a
request the cache cannot hold even alone; the message starts with the entry point's name. The
value coercions underneath (integers, reals, temperatures, token ids) are tonp_models.checks'.
"""
from __future__ import annotations

import collections
import collections.abc
from typing import Callable, List, Optional, Sequence

from ..checks import as_int, as_real, check_temperature, in_vocabulary, show
from ..layers import CacheFullError
from .request import SamplingParams

NOISE_KEYS = 2**63   # noise keys (request ids) lie in [0, 2**63): the sampling kernel's int64
SEEDS = 2**64        # seeds lie in [0, 2**64): the kernel hashes them as uint64


def _field(name: str, check: Callable):
    """check() with its TypeError / ValueError tagged with the argument it is about."""
    try:
        return check()
    except (TypeError, ValueError) as e:
        e.field = name
        raise


def token_set(who: str, name: str, ids, vocab: int) -> frozenset:
    """eos / stop ids: None, one token id, or a list / tuple / set / 1-D tensor or array of them
    (ints, numpy integers, 0-d integer tensors), each in [0, vocab)."""
    if ids is None:
        return frozenset()
    many = isinstance(ids, (list, tuple, set, frozenset, range)) or getattr(ids, "ndim", 0) == 1
    return frozenset(as_int(who, f"{name}[{j}]" if many else name, v, 0, vocab)
                     for j, v in enumerate(ids if many else [ids]))


def sampling(who: str, *, max_new_tokens, vocab: int, temperature=0.0, top_k=None, top_p=None,
             seed=0, eos_token_ids=None, stop_token_ids=None, top_logprobs=0,
             max_top_logprobs: Optional[int] = None) -> SamplingParams:
    """SamplingParams from a request's values, each checked (see SamplingParams): max_new_tokens
    an int >= 0; temperature 0 (greedy) or a normal fp32 number; top_k None or an int >= 1;
    top_p None or a real in (0, 1]; seed an int in [0, 2**64); eos / stop ids as `token_set`;
    top_logprobs an int in [0, max_top_logprobs] (None = no upper bound)."""
    new = _field("max_new_tokens", lambda: as_int(who, "max_new_tokens", max_new_tokens, 0))
    t = _field("temperature", lambda: check_temperature(who, temperature, greedy_ok=True))
    k = None if top_k is None else _field("top_k", lambda: as_int(who, "top_k", top_k, 1))
    p = None if top_p is None else _field("top_p", lambda: _top_p(who, top_p))
    s = _field("seed", lambda: as_int(who, "seed", seed, 0, SEEDS))
    eos = _field("eos_token_id", lambda: token_set(who, "eos_token_id", eos_token_ids, vocab))
    stop = _field("stop_token_ids", lambda: token_set(who, "stop_token_ids", stop_token_ids,
                                                      vocab))
    top = _field("top_logprobs", lambda: _top_logprobs(who, top_logprobs, max_top_logprobs))
    return SamplingParams(new, t, k, p, s, eos, stop, top)


def _top_logprobs(who: str, n, most: Optional[int]) -> int:
    n = as_int(who, "top_logprobs", n, 0)
    if most is not None and n > most:
        raise ValueError(f"{who}: top_logprobs must be at most {most}, got {n}")
    return n


def _top_p(who: str, top_p) -> float:
    p = as_real(who, "top_p", top_p)
    if not 0.0 < p <= 1.0:
        raise ValueError(f"{who}: top_p must be in (0, 1], got {p!r}")
    return p


def noise_key(who: str, name: str, key) -> int:
    """One request's noise key: an int in [0, 2**63)."""
    return _field("request_ids", lambda: as_int(who, name, key, 0, NOISE_KEYS))


def noise_keys(who: str, request_ids, n: int) -> List[int]:
    """The noise keys of n requests: distinct ints in [0, 2**63); None = 0..n-1."""
    if request_ids is None:
        return list(range(n))
    if isinstance(request_ids, (str, bytes)) or getattr(request_ids, "ndim", 1) != 1 or \
            not isinstance(request_ids, collections.abc.Iterable):
        raise _tagged(TypeError(f"{who}: request_ids must be a sequence of ints, got "
                                f"{show(request_ids)}"), "request_ids")
    keys = [noise_key(who, f"request_ids[{j}]", v) for j, v in enumerate(request_ids)]
    if len(keys) != n:
        raise _tagged(ValueError(f"{who}: request_ids must be {n} ints (one per request), got "
                                 f"{len(keys)}"), "request_ids")
    dup = sorted(i for i, c in collections.Counter(keys).items() if c > 1)
    if dup:
        raise _tagged(ValueError(f"{who}: request_ids must be distinct (they key each "
                                 f"request's sampling noise); {dup[:8]} occur more than once"),
                      "request_ids")
    return keys


def _tagged(e: Exception, name: str) -> Exception:
    e.field = name
    return e


def prompt(who: str, name: str, tokens: Sequence[int], max_new_tokens: int, *, vocab: int,
           context: int, limit: str = "max_position_embeddings") -> None:
    """A prompt (a list of ints) that can run: at least one token, every id in [0, vocab), and
    prompt + max_new_tokens tokens within `context` (named by `limit`). name: "request x"."""
    n = len(tokens)
    if n == 0:
        raise _tagged(ValueError(f"{who}: {name}: the prompt is empty (a prompt needs at least "
                                 f"one token)"), "prompt")
    try:
        in_vocabulary(who, f"{name}: the prompt", tokens, vocab)
    except IndexError as e:
        e.field = "prompt"
        raise
    if n + max_new_tokens > context:
        raise _tagged(ValueError(f"{who}: {name}: the prompt ({n} tokens) + max_new_tokens="
                                 f"{max_new_tokens} = {n + max_new_tokens} tokens exceeds the "
                                 f"context of {context} tokens ({limit})"), "max_new_tokens")


def positions(prompt_len: int, max_new_tokens: int) -> int:
    """The cache positions a request writes at most: its last new token is never fed."""
    return prompt_len + max(max_new_tokens, 1) - 1


def fits_cache(who: str, name: str, positions: int, *, page_size: int, num_pages: int) -> None:
    """CacheFullError unless `positions` positions fit in num_pages pages of page_size."""
    pages = -(-positions // page_size)
    if pages > num_pages:
        raise CacheFullError(f"{who}: {name} needs {pages} KV-cache pages of {page_size} "
                             f"positions ({positions} positions) but the cache holds num_pages="
                             f"{num_pages}; it cannot run even alone")


__all__ = ["NOISE_KEYS", "SEEDS", "sampling", "token_set", "noise_key", "noise_keys", "prompt",
           "positions", "fits_cache"]
