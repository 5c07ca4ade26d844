"""tonp's block spec as pipeline stages of a megatron-core model.

Under megatron's parallel_state at PP 2 (gloo, 2 ranks) each rank builds a TransformerBlock
from `get_tonp_block_spec(config)`: stage 0 gets layers 0-1, stage 1 layers 2-3 with their
global layer numbers and the final norm. Stage 0's output travels to stage 1
(`set_input_tensor`, as megatron's schedules hand it over), whose logits equal tonp's own
one-process model bit for bit; the loss's gradient travels back and each stage's parameter
gradients match the one-process model's within 2e-6 + 1e-5 |g|.
Megatron's own schedules (forward_backward_pipelining_*) are not run here: megatron-core 0.16
allocates their receive buffers and token counters on CUDA (p2p_communication.py's
`torch.cuda.current_device()`, schedules.py's `device="cuda"`), which the CPU test world lacks.
"""
import logging
import warnings

import pytest
import torch

import megatron.core  # noqa: E402,F401  (requirements-test.txt pins it: a broken install fails)
warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
logging.getLogger("megatron.core.transformer.transformer_layer").setLevel(logging.ERROR)

from dist_utils import run_distributed  # noqa: E402
from model_helpers import random_seqs, tiny_model  # noqa: E402


def _stage_rank():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_block import TransformerBlock

    from tonp_models.megatron import (get_tonp_block_spec, load_global_state_dict,
                                      transformer_config_from_qwen3)
    from tonp_models.qwen3_moe import megatron_convert as mc
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    stage = ps.get_pipeline_model_parallel_rank()
    model = tiny_model("mlp_only", num_hidden_layers=4)      # the one-process model, each rank
    c = model.config
    tc = transformer_config_from_qwen3(c, pipeline_model_parallel_size=2)
    spec = get_tonp_block_spec(tc, rotary_base=c.rope_theta,
                               max_position_embeddings=c.max_position_embeddings,
                               attention_block=c.attention_block,
                               reduction_chunks=c.reduction_chunks)
    block = TransformerBlock(tc, spec, pre_process=stage == 0, post_process=stage == 1)
    offset = 2 * stage                                         # global layer = local + offset
    full = mc.tonp_to_spec(model.state_dict(), block_only=True)
    mine = {}
    for k, v in full.items():
        parts = k.split(".")
        if parts[0] == "layers" and offset <= int(parts[1]) < offset + 2:
            mine[".".join(["layers", str(int(parts[1]) - offset), *parts[2:]])] = v
        elif parts[0] != "layers" and stage == 1:
            mine[k] = v
    missing, unexpected = load_global_state_dict(block, mine, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing,
                                                                                  unexpected)
    seqs = random_seqs([9, 9], c.vocab_size, seed=6)
    ids = torch.stack(seqs)                                    # (b, s)
    out = dict(stage=stage, numbers=[layer.layer_number for layer in block.layers])
    if stage == 0:
        h = model.embed_tokens(ids).transpose(0, 1).contiguous()   # (s, b, h)
        y = block(h, attention_mask=None)
        dist.send(y.detach(), 1)
        grad = torch.empty_like(y)
        dist.recv(grad, 1)
        y.backward(grad)
    else:
        x = torch.empty(9, 2, c.hidden_size)
        dist.recv(x, 0)
        x.requires_grad_(True)
        block.set_input_tensor(x)
        logits = model.lm_head(block(None, attention_mask=None))  # (s, b, V)
        out["logits"] = logits.detach().transpose(0, 1).reshape(18, -1)
        logits.float().logsumexp(-1).mean().backward()
        dist.send(x.grad, 0)
    out["grads"] = {k: p.grad.clone() for k, p in block.named_parameters() if p.grad is not None}
    ps.destroy_model_parallel()
    return out


@pytest.mark.timeout(300)
def test_tonp_block_spec_as_megatron_pipeline_stages():
    from tonp_models.qwen3_moe import megatron_convert as mc
    stages = run_distributed(_stage_rank, 2, timeout=240)
    model = tiny_model("mlp_only", num_hidden_layers=4)
    seqs = random_seqs([9, 9], model.config.vocab_size, seed=6)
    ids, cu = torch.cat(seqs), torch.tensor([0, 9, 18], dtype=torch.int32)
    logits = model(ids, cu)
    assert [s["numbers"] for s in stages] == [[1, 2], [3, 4]]
    assert torch.equal(stages[1]["logits"], logits.detach())
    logits.view(2, 9, -1).transpose(0, 1).float().logsumexp(-1).mean().backward()
    want = mc.tonp_to_spec({k: p.grad for k, p in model.named_parameters()}, block_only=True)
    for s in stages:
        assert s["grads"]
        for k, g in s["grads"].items():
            parts = k.split(".")
            if parts[0] == "layers":
                k = ".".join(["layers", str(int(parts[1]) + 2 * s["stage"]), *parts[2:]])
            torch.testing.assert_close(g, want[k], atol=2e-6, rtol=1e-5, msg=k)
