"""Write the small synthetic corpora the examples train on (deterministic; no downloads).

    python examples/make_corpus.py            # -> examples/data/corpus.txt, examples/data/sft.jsonl

corpus.txt: plain English-like text from a small grammar (sentences about animals and places),
arithmetic facts ("3 plus 4 is 7."), counting runs and key/value records, so a byte-level model has
both local structure (spelling) and longer-range structure (arithmetic, counting) to learn.
sft.jsonl: {"prompt", "response"} pairs (questions and answers about sums, opposites and colours).
The same seed always gives byte-identical files.
"""
from __future__ import annotations

import argparse
import json
import os
import random
from typing import List

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")

ANIMALS = ["cat", "dog", "fox", "owl", "bear", "wolf", "hare", "duck", "goat", "frog"]
COLOURS = ["red", "blue", "green", "brown", "white", "black", "grey", "gold"]
PLACES = ["the river", "the hill", "the barn", "the forest", "the field", "the lake"]
VERBS = ["runs to", "walks to", "sleeps near", "looks at", "jumps over", "sings by"]
TIMES = ["in the morning", "at night", "after the rain", "before noon", "every day"]
OPPOSITES = {"hot": "cold", "big": "small", "fast": "slow", "up": "down", "old": "new",
             "light": "dark", "early": "late", "full": "empty"}
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def _sentence(rng: random.Random) -> str:
    kind = rng.randrange(5)
    if kind == 0:
        return (f"the {rng.choice(COLOURS)} {rng.choice(ANIMALS)} {rng.choice(VERBS)} "
                f"{rng.choice(PLACES)} {rng.choice(TIMES)}.")
    if kind == 1:
        a, b = rng.randrange(10), rng.randrange(10)
        return f"{a} plus {b} is {a + b}."
    if kind == 2:
        start = rng.randrange(20)
        return "count: " + " ".join(str(i) for i in range(start, start + rng.randrange(3, 8))) + "."
    if kind == 3:
        word = rng.choice(list(OPPOSITES))
        return f"the opposite of {word} is {OPPOSITES[word]}."
    n = rng.randrange(10)
    return f"{NUMBERS[n]} is written {n}."


def corpus_text(num_bytes: int = 120_000, seed: int = 0) -> str:
    """About num_bytes of paragraphs (3-6 sentences each, a blank line between)."""
    rng = random.Random(seed)
    paras: List[str] = []
    size = 0
    while size < num_bytes:
        p = " ".join(_sentence(rng) for _ in range(rng.randrange(3, 7)))
        paras.append(p)
        size += len(p) + 2
    return "\n\n".join(paras) + "\n"


def sft_pairs(n: int = 400, seed: int = 1) -> List[dict]:
    """Question/answer pairs; the answer alone is the response (the loss is on it only)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        kind = rng.randrange(3)
        if kind == 0:
            a, b = rng.randrange(10), rng.randrange(10)
            out.append({"prompt": f"Q: what is {a} plus {b}?\nA:", "response": f" {a + b}."})
        elif kind == 1:
            w = rng.choice(list(OPPOSITES))
            out.append({"prompt": f"Q: the opposite of {w}?\nA:", "response": f" {OPPOSITES[w]}."})
        else:
            n_ = rng.randrange(10)
            out.append({"prompt": f"Q: how is {NUMBERS[n_]} written?\nA:", "response": f" {n_}."})
    return out


def write(data_dir: str = DATA_DIR, num_bytes: int = 120_000, seed: int = 0) -> None:
    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(data_dir, "corpus.txt"), "w", encoding="utf-8", newline="\n") as f:
        f.write(corpus_text(num_bytes, seed))
    with open(os.path.join(data_dir, "sft.jsonl"), "w", encoding="utf-8", newline="\n") as f:
        for row in sft_pairs(seed=seed + 1):
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=DATA_DIR)
    ap.add_argument("--bytes", type=int, default=120_000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    write(a.out_dir, a.bytes, a.seed)
    print(f"wrote {a.out_dir}/corpus.txt and sft.jsonl")
