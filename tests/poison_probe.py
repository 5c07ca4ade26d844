"""Run by test_kernels_misc.py in a subprocess (with and without TONP_POISON=1): a set of op
outputs over shapes that take every layout (dot tiles, lane passes, pool blocks, reused
scratch), saved to argv[1]."""
import sys

import torch

import tonp_kernels as tk
from tonp_models import Qwen3MoeConfig, Qwen3MoeForCausalLM, generate

torch.manual_seed(0)
out = {}
for dt in (torch.float32, torch.bfloat16):
    for M in (1, 5, 13, 50, 300, 700):
        for K, N in ((2048, 1536), (768, 200)):
            x, w = torch.randn(M, K).to(dt), torch.randn(N, K).to(dt)
            out[f"linear {dt} {M} {K}"] = tk.linear(x, w, chunks=8)
    x = torch.randn(600, 2048).to(dt)
    out[f"rms_norm {dt}"] = tk.rms_norm(x, torch.ones(2048).to(dt), 1e-6)
    ids = torch.stack([torch.randperm(16)[:4] for _ in range(300)])
    gu, dn = torch.randn(16, 256, 512).to(dt), torch.randn(16, 512, 128).to(dt)
    out[f"moe_experts {dt}"] = tk.moe_experts(torch.randn(300, 512).to(dt), ids, gu, dn)
cfg = Qwen3MoeConfig.preset("tiny")
model = Qwen3MoeForCausalLM(cfg)
prompts = [torch.randint(0, 256, (n,)) for n in (3, 17, 40)]
res = generate(model, prompts, 6)
out["generate"] = torch.cat([torch.cat(list(res.sequences)).float(), torch.cat(list(res.logprobs))])
out["train"] = torch.cat([lp.detach() for lp in model.token_logprobs(res.sequences)])
torch.save(out, sys.argv[1])
