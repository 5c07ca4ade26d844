"""Another project's megatron-core model, running tonp's layers (CPU, one process).

    .venv/bin/python examples/megatron_layers.py

1. a megatron-core GPTModel whose TransformerBlock uses tonp's spec (RMSNorm, attention, MoE),
   initialised from a megatron-core checkpoint converted to the spec's names;
2. a training step through megatron's own loss (forward + backward + SGD);
3. KV-cached decoding through megatron's StaticInferenceContext equals the full pass, bitwise;
4. the trained weights go back to tonp's own model, whose rollout and training forward agree
   bit for bit (logdiff 0), and out to the HF and megatron-core layouts.
"""
import logging
import os
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")                 # "Transformer Engine / Apex not installed"
logging.getLogger("megatron").setLevel(logging.ERROR)

from megatron.core import parallel_state  # noqa: E402
from megatron.core.inference.contexts import StaticInferenceContext  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402

from tonp_models import Qwen3MoeConfig, Qwen3MoeForCausalLM, generate  # noqa: E402
from tonp_models.megatron import get_tonp_block_spec, transformer_config_from_qwen3  # noqa: E402
from tonp_models.qwen3_moe import megatron_convert as mc  # noqa: E402


def main():
    # A megatron project initialises torch.distributed and parallel_state (here: 1 CPU process).
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)

    cfg = Qwen3MoeConfig.preset("tiny", mlp_only_layers=[1], initializer_range=0.08)
    config = transformer_config_from_qwen3(cfg)   # or your own TransformerConfig: refused
    #                                               settings raise one error listing them
    spec = get_tonp_block_spec(config, rotary_base=cfg.rope_theta,
                               max_position_embeddings=cfg.max_position_embeddings,
                               attention_block=cfg.attention_block,
                               reduction_chunks=cfg.reduction_chunks)
    # position_embedding_type="none": tonp's attention applies RoPE from its own tables
    # (megatron's RotaryEmbedding moves its table to CUDA, so "rope" needs a GPU).
    gpt = GPTModel(config, spec, vocab_size=cfg.vocab_size,
                   max_sequence_length=cfg.max_position_embeddings,
                   position_embedding_type="none")

    # 1. weights from a megatron-core checkpoint (here made up: a seeded tonp model's weights in
    #    megatron-core's GPT layout, fused QKV and gate/up, as a TE-trained model saves them).
    torch.manual_seed(0)
    mcore_sd = mc.tonp_to_megatron(Qwen3MoeForCausalLM(cfg).state_dict(), cfg, fused_norms=True)
    tonp_sd = mc.megatron_to_tonp(mcore_sd, cfg, fused_norms=True)
    missing, unexpected = gpt.load_state_dict(mc.tonp_to_spec(tonp_sd), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    print(f"GPTModel with tonp layers: {sum(p.numel() for p in gpt.parameters())} parameters; "
          f"layer 0 MLP is {type(gpt.decoder.layers[0].mlp).__name__}")

    # 2. one training step with megatron's loss.
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=g)                 # [b, s]
    loss = gpt(ids[:, :-1], None, attention_mask=None, labels=ids[:, 1:]).mean()
    loss.backward()
    with torch.no_grad():
        for p in gpt.parameters():
            p -= 0.1 * p.grad
    print(f"train step: loss {loss.item():.4f}")

    # 3. cached decode through megatron's StaticInferenceContext == the full pass, bitwise.
    gpt.eval()
    with torch.no_grad():
        h = gpt.embedding(ids, None)                                               # [s, b, h]
        full = gpt.decoder(h, attention_mask=None)
        ctx = StaticInferenceContext(max_batch_size=2, max_sequence_length=32)
        steps = []
        for a, b in [(0, 20)] + [(t, t + 1) for t in range(20, 24)]:               # prefill, decode
            steps.append(gpt.decoder(h[a:b], attention_mask=None, inference_context=ctx))
            ctx.increment_sequence_len_offset(b - a)
    print(f"cached decode equals the full pass: {torch.equal(torch.cat(steps), full)}")

    # 4. back to tonp's model (rollout engine), and out to HF / megatron-core layouts.
    trained = mc.spec_to_tonp(gpt.state_dict())
    model = Qwen3MoeForCausalLM(cfg)
    model.load_state_dict(trained)
    prompts = [ids[0, :5], ids[1, :9]]
    with torch.no_grad():
        out = generate(model, prompts, max_new_tokens=8, temperature=1.0, seed=7)
        lps = model.token_logprobs(out.sequences, temperature=1.0)
    logdiff = max((lp[len(p) - 1:] - r).abs().max().item()
                  for p, lp, r in zip(prompts, lps, out.logprobs))
    print(f"tonp rollout vs training forward on the trained weights: logdiff {logdiff}")
    hf_sd = mc.tonp_to_hf(trained, cfg)
    mcore_sd = mc.tonp_to_megatron(trained, cfg)
    print(f"exported {len(hf_sd)} HF tensors and {len(mcore_sd)} megatron-core tensors")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
