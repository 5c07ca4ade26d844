"""Replays the requests of SGLang's determinism check (sglang/test/test_deterministic.py) against
a running server and counts the unique outputs of each prompt (SGLang's check expects 1).

Modes, as SGLang's: "single" (one prompt in batches of 1..N), "mixed" (two short prompts and a
long one in one batch; here also shuffled), "prefix" (prompts that share a long prompt's first k
characters, with POST /flush_cache, bodiless as SGLang sends it, before each trial; its answers
are in `Report.flushes`, and SGLang's script ignores them); and its newer "p_vs_d" (decode vs
prefill logprobs of the same sequences, `logprob_start_len` 0) and "radix_cache". Every body
is SGLang's: `text` (a list), `sampling_params` {temperature, max_new_tokens, frequency_penalty
0.0, presence_penalty 0.0, sampling_seed}, `return_logprob`, `stream`.

    python tests/sglang_replay.py --url http://127.0.0.1:30000 --mode single --n-trials 8 \\
        --temperature 1 --sampling-seed 42 --return-logprob        # exit status 1: not unique

Stricter than SGLang's script: every position of every batch counts (its single mode reads the
first result only), a non-200 answer raises, and the output token ids and (with
--return-logprob) the sequence of logprobs count as well as the text. Standard library only.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

PROMPT_1 = "Tell me about the life of Emmy Noether: "
PROMPT_2 = "Write down 500 random digits. Start at once with a digit, and say nothing else."
PREFIX_LENS = (1, 511, 2048, 4097)      # SGLang's shared-prefix lengths (characters)


def long_prompt(chars: int = 5000, seed: int = 0) -> str:
    """A long English-like text (seeded word salad) of at least `chars` characters."""
    words = ("the of and to in is was for on that with as by at from his her an which be this "
             "river mountain number proof algebra ring field theorem winter letter city music "
             "engine garden window paper light silver north quiet").split()
    rng, out, n = random.Random(seed), [], 0
    while n < chars:
        w = rng.choice(words)
        out.append(w)
        n += len(w) + 1
    return " ".join(out) + "."


class ReplayError(RuntimeError):
    pass


def post(url: str, path: str, body: Optional[dict] = None, timeout: float = 120.0):
    """(status, JSON or text) of a POST; body None: no body at all (as `requests.post(url)`)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {} if body is None else {"Content-Type": "application/json"}
    req = urllib.request.Request(url.rstrip("/") + path, data=data or b"", headers=headers,
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    text = raw.decode(errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def _stream(url: str, body: dict, timeout: float) -> List[dict]:
    """The last event of each index (SGLang streams each prompt's whole result so far)."""
    req = urllib.request.Request(url.rstrip("/") + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    last: Dict[int, dict] = {}
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise ReplayError(f"/generate streamed an error: {event['error']}")
            last[event.get("index", 0)] = event
    return [last[i] for i in sorted(last)]


@dataclass
class Args:
    url: str
    temperature: float = 0.0
    sampling_seed: Optional[int] = 42
    max_new_tokens: int = 100
    return_logprob: bool = False
    stream: bool = False
    n_trials: int = 50
    prefix_lens: Tuple[int, ...] = PREFIX_LENS
    long_chars: int = 5000
    rng_seed: int = 0
    vocab: int = 50000          # radix_cache's random prompt ids lie below it
    timeout: float = 300.0


def send(args: Args, texts: List[str]) -> List[dict]:
    """One /generate of SGLang's script: the results, in the order of `texts`."""
    body = {"text": texts, "sampling_params": {
        "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
        "frequency_penalty": 0.0, "presence_penalty": 0.0},
        "return_logprob": args.return_logprob, "stream": args.stream}
    if args.sampling_seed is not None:
        body["sampling_params"]["sampling_seed"] = args.sampling_seed
    if args.stream:
        out = _stream(args.url, body, args.timeout)
    else:
        status, out = post(args.url, "/generate", body, args.timeout)
        if status != 200:
            raise ReplayError(f"/generate answered {status}: {out}")
    if not isinstance(out, list) or len(out) != len(texts):
        raise ReplayError(f"/generate gave {len(out)} results for {len(texts)} prompts")
    return out


@dataclass
class Sample:
    text: str
    output_ids: Tuple[int, ...]
    logprobs: Optional[Tuple[float, ...]]

    @classmethod
    def of(cls, r: dict) -> "Sample":
        lps = r["meta_info"].get("output_token_logprobs")
        return cls(r["text"], tuple(r["output_ids"]),
                   None if lps is None else tuple(float(e[0]) for e in lps))


@dataclass
class Report:
    """The samples of each prompt (by name) and the prompt texts."""
    prompts: Dict[str, str] = field(default_factory=dict)
    samples: Dict[str, List[Sample]] = field(default_factory=dict)
    flushes: List[Tuple[int, str]] = field(default_factory=list)   # /flush_cache answers

    def add(self, name: str, text: str, result: dict) -> None:
        self.prompts[name] = text
        self.samples.setdefault(name, []).append(Sample.of(result))

    def unique(self) -> Dict[str, Tuple[int, int, int, int]]:
        """name -> (samples, unique texts, unique output ids, unique logprob sequences)."""
        return {k: (len(v), len({s.text for s in v}), len({s.output_ids for s in v}),
                    len({s.logprobs for s in v})) for k, v in self.samples.items()}


def single(args: Args) -> Report:
    rep = Report()
    for bs in range(1, args.n_trials + 1):
        for r in send(args, [PROMPT_1] * bs):
            rep.add("prompt_1", PROMPT_1, r)
    return rep


def mixed(args: Args) -> Report:
    rng, rep, long = random.Random(args.rng_seed), Report(), long_prompt(args.long_chars)
    named = {"prompt_1": PROMPT_1, "prompt_2": PROMPT_2, "long_prompt": long}
    for bs in range(1, args.n_trials + 1):
        n_long = rng.randint(0, bs - 1)
        n1 = rng.randint(1, bs - n_long)
        names = ["prompt_1"] * n1 + ["prompt_2"] * (bs - n1 - n_long) + ["long_prompt"] * n_long
        rng.shuffle(names)
        for name, r in zip(names, send(args, [named[x] for x in names])):
            rep.add(name, named[name], r)
    return rep


def prefix(args: Args) -> Report:
    rng, rep, long = random.Random(args.rng_seed), Report(), long_prompt(args.long_chars)
    prompts = {f"prefix_{k}": long[:k] for k in args.prefix_lens}
    names = list(prompts)
    for bs in range(1, args.n_trials + 1):
        rep.flushes.append(post(args.url, "/flush_cache", None, args.timeout))
        batch = [rng.choice(names) for _ in range(bs)]
        for name, r in zip(batch, send(args, [prompts[x] for x in batch])):
            rep.add(name, prompts[name], r)
    return rep


def _generate(args: Args, extra: dict) -> List[dict]:
    body = {"return_logprob": True, "logprob_start_len": 0, "return_text_in_logprobs": True,
            "sampling_params": {"temperature": args.temperature, "max_new_tokens":
                                args.max_new_tokens, "frequency_penalty": 0.0,
                                "presence_penalty": 0.0}}
    if args.sampling_seed is not None:
        body["sampling_params"]["sampling_seed"] = args.sampling_seed
    for k, v in extra.items():
        if k == "sampling_params":
            body[k] = dict(body[k], **v)
        else:
            body[k] = v
    status, out = post(args.url, "/generate", body, args.timeout)
    if status != 200:
        raise ReplayError(f"/generate answered {status}: {out}")
    return out if isinstance(out, list) else [out]


def _pairs(entries) -> Tuple[Tuple[int, ...], Tuple[Optional[float], ...]]:
    return tuple(e[1] for e in entries), tuple(e[0] for e in entries)


def p_vs_d(args: Args) -> Report:
    """SGLang's newer "p_vs_d" mode: generate (prompt logprobs from position 0 too), then feed
    each whole sequence back as a prompt (cache flushed): the prefill's logprobs of every
    position must equal what decoding reported. One request of n_trials prompts."""
    rng, rep, long = random.Random(args.rng_seed), Report(), long_prompt(args.long_chars)
    texts = [PROMPT_1, PROMPT_2]
    while len(texts) < args.n_trials:
        end = rng.randrange(1, len(long))
        texts.append(long[rng.randrange(0, end) if rng.random() < 0.5 else 0:end])
    texts = texts[:args.n_trials]
    rep.flushes.append(post(args.url, "/flush_cache", None, args.timeout))
    first = _generate(args, {"text": texts})
    rep.flushes.append(post(args.url, "/flush_cache", None, args.timeout))
    seqs = [_pairs(r["meta_info"]["input_token_logprobs"] + r["meta_info"]
                   ["output_token_logprobs"]) for r in first]
    again = _generate(args, {"input_ids": [list(ids) for ids, _ in seqs],
                             "sampling_params": {"max_new_tokens": 1}})
    for i, (t, (ids, lps), r) in enumerate(zip(texts, seqs, again)):
        rep.prompts[f"seq_{i}"] = t
        ids2, lps2 = _pairs(r["meta_info"]["input_token_logprobs"])
        rep.samples[f"seq_{i}"] = [Sample("", ids, lps), Sample("", ids2, lps2)]
    return rep


def radix(args: Args, prefix_len: int = 100) -> Report:
    """SGLang's newer "radix_cache" mode: the logprob of one token decoded, prefilled with the
    prefix cache hit, and prefilled cold (SGLang expects only the last two to agree)."""
    rng, rep = random.Random(42), Report()
    ids = [rng.randint(min(100, args.vocab - 1), args.vocab - 1) for _ in range(prefix_len)]
    _generate(args, {"input_ids": [1] * 64, "sampling_params": {"max_new_tokens": 65}})
    rep.flushes.append(post(args.url, "/flush_cache", None, args.timeout))
    a = _generate(args, {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}})[0]
    prompt = ids + a["output_ids"][:-1]
    hit = _generate(args, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}})[0]
    rep.flushes.append(post(args.url, "/flush_cache", None, args.timeout))
    cold = _generate(args, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}})[0]
    rep.prompts["last_token"] = ""
    rep.samples["last_token"] = [Sample("", *_pairs(r["meta_info"]["output_token_logprobs"]
                                                    [-1:])) for r in (a, hit, cold)]
    return rep


MODES = {"single": single, "mixed": mixed, "prefix": prefix, "p_vs_d": p_vs_d,
         "radix_cache": radix}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--mode", choices=sorted(MODES), default="single")
    ap.add_argument("--n-trials", type=int, default=50)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--sampling-seed", type=int, default=42, help="-1: send none")
    ap.add_argument("--max-new-tokens", type=int, default=100)
    ap.add_argument("--return-logprob", action="store_true")
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--vocab", type=int, default=50000, help="radix_cache's prompt ids < it")
    a = ap.parse_args(argv)
    args = Args(a.url, a.temperature, None if a.sampling_seed == -1 else a.sampling_seed,
                a.max_new_tokens, a.return_logprob, a.stream, a.n_trials, vocab=a.vocab)
    worst, rep = 1, MODES[a.mode](args)
    for status, text in rep.flushes:
        if status != 200:
            print(f"warning: /flush_cache answered {status}: {text}")
    for name, (n, texts, ids, lps) in rep.unique().items():
        print(f"{name}: total samples: {n}, unique samples: {texts} (texts), {ids} (token ids),"
              f" {lps} (logprob sequences)")
        worst = max(worst, texts, ids, lps)
    return 0 if worst == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
