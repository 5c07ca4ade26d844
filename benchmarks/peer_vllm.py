"""The vLLM side of `decode_bench.py`: runs inside vLLM's own venv (`make peer-vllm`), never the
project's, and answers one JSON line per request on stdin:

    {"prompts": [[ids...], ...], "new": 32}  ->  {"seconds": s, "tokens": [[...]],
                                                  "logprobs": [[...]]}

Greedy, eos ignored, the sampled token's logprob returned (`logprobs=0`), prompts as token ids
(no tokenizer). The parent pauses this process group (SIGSTOP) while it times tonp, so an idle
vLLM engine (whose workers keep spinning) does not slow the other contender.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="an HF checkpoint directory")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096,
                    help="tokens a forward feeds at most (vLLM's default for LLM on CPU)")
    ap.add_argument("--eager", action="store_true", help="no torch.compile (vLLM's default "
                    "compiles the model: minutes on a small machine)")
    a = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams, TokensPrompt
    llm = LLM(model=a.model, dtype=a.dtype, skip_tokenizer_init=True, enforce_eager=a.eager,
              max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs, seed=0,
              max_num_batched_tokens=a.max_num_batched_tokens,
              enable_prefix_caching=False)
    print(json.dumps({"ready": True, "vllm": __import__("vllm").__version__}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        sp = SamplingParams(temperature=0.0, max_tokens=req["new"], ignore_eos=True,
                            logprobs=0, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        toks, lps = [], []
        for o in outs:
            c = o.outputs[0]
            toks.append(list(c.token_ids))
            lps.append([d[t].logprob for d, t in zip(c.logprobs, c.token_ids)])
        print(json.dumps({"seconds": dt, "tokens": toks, "logprobs": lps}), flush=True)


if __name__ == "__main__":
    main()
