"""Qwen3MoeForCausalLM matches transformers' Qwen3MoeForCausalLM (the numerics oracle).

Random tiny configs cover mlp_only_layers, decoder_sparse_step > 1, norm_topk_prob False and
tied embeddings; in both kernel modes the fp32 logits are allclose and greedy continuations
(transformers' generate vs a greedy loop over tonp's cached forward) are identical. Bad input
raises a clear error.
"""
from __future__ import annotations

import pytest
import torch

import tonp_kernels as tk
from tonp_models import Qwen3MoeConfig, Qwen3MoeForCausalLM
from tonp_models.engine import PageAllocator, extend
from tonp_models.layers import CacheFullError
from model_helpers import CONFIGS, hf_twin, packed, random_seqs, tiny_model

MODES = ("torch", "invariant")


def greedy(model, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """Prefill the prompt into a cache, then decode n tokens one at a time (argmax)."""
    pages = PageAllocator(model.new_cache(1, len(prompt) + n))
    slot = pages.add_sequence()
    ids, out = prompt, []
    for _ in range(n):
        logits = extend(model, pages, ids, [slot])                               # (t, V)
        ids = tk.argmax(logits[-1:])
        out.append(ids)
    return torch.cat([prompt, *out])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_greedy_match_transformers(name, mode, tmp_path):
    model = tiny_model(name)
    hf = hf_twin(model, tmp_path)
    seqs = random_seqs([37, 5, 20], model.config.vocab_size)
    with tk.use(mode), torch.no_grad():
        ids, cu = packed(seqs)
        ours = model(ids, cu)                                                      # (T, V)
        for s, (a, b) in zip(seqs, zip(cu[:-1].tolist(), cu[1:].tolist())):
            ref = hf(s[None]).logits[0].float()
            torch.testing.assert_close(ours[a:b], ref, rtol=1e-4, atol=1e-5)
        prompt = seqs[1]
        expected = hf.generate(prompt[None], max_new_tokens=8, do_sample=False,
                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               pad_token_id=0)[0]
        assert torch.equal(greedy(model, prompt, 8), expected)


@pytest.mark.parametrize("mode", MODES)
def test_padded_batch_matches_transformers(mode, tmp_path):
    """Right-padded [B, L] input with an attention mask: real rows match, pad rows are 0."""
    model = tiny_model("sparse_step2")
    hf = hf_twin(model, tmp_path)
    seqs = random_seqs([9, 16, 3], model.config.vocab_size, seed=1)
    ids = torch.zeros(3, 16, dtype=torch.long)
    mask = torch.zeros(3, 16, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
    with tk.use(mode), torch.no_grad():
        out = model(ids, attention_mask=mask)
        assert out.shape == (3, 16, model.config.vocab_size) and out.dtype == torch.float32
        for i, s in enumerate(seqs):
            ref = hf(s[None]).logits[0].float()
            torch.testing.assert_close(out[i, :len(s)], ref, rtol=1e-4, atol=1e-5)
            assert not out[i, len(s):].any()


@pytest.mark.parametrize("mode", MODES)
def test_bf16_close_to_transformers(mode, tmp_path):
    """bf16 weights and activations: logits within bf16 rounding of transformers' bf16 run,
    except at the odd position where a bf16 near-tie flips a routing decision."""
    model = tiny_model("mlp_only", dtype=torch.bfloat16)
    hf = hf_twin(model, tmp_path)
    s = random_seqs([24], model.config.vocab_size)[0]
    with tk.use(mode), torch.no_grad():
        ours = model(s)
        ref = hf(s[None]).logits[0].float()
    assert ours.dtype == torch.float32
    per_position = (ours - ref).abs().max(-1).values                               # (T,)
    assert (per_position < 0.03 * ref.abs().max()).sum() >= len(s) - 2, per_position


@pytest.mark.parametrize("mode", MODES)
def test_training_forward_has_gradients(mode):
    """The same forward trains: token_logprobs backpropagates into every parameter."""
    model = tiny_model("mlp_only")
    with tk.use(mode):
        lps = model.token_logprobs(random_seqs([12, 7], model.config.vocab_size))
        torch.cat(lps).sum().backward()
    for name, p in model.named_parameters():
        if p.dim() == 3:
            continue  # experts nobody routed to get no gradient
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_token_logprobs_match_log_softmax():
    model = tiny_model("tied")
    seqs = random_seqs([10, 1, 6], model.config.vocab_size)
    with tk.use("torch"), torch.no_grad():
        lps = model.token_logprobs(seqs, temperature=0.7)
        for s, lp in zip(seqs, lps):
            ref = torch.log_softmax(model(s) / 0.7, -1)[:-1].gather(-1, s[1:, None])[:, 0]
            assert lp.dtype == torch.float32 and lp.shape == (len(s) - 1,)
            torch.testing.assert_close(lp, ref)


# ---------------------------------------------------------------------------------------------
# Clear errors
# ---------------------------------------------------------------------------------------------
def test_token_id_out_of_range():
    model = tiny_model()
    with tk.use("torch"), pytest.raises(IndexError, match="input_ids holds .* outside the vocab"):
        model(torch.tensor([1, 2, model.config.vocab_size]))
    with tk.use("torch"), pytest.raises(IndexError, match="input_ids holds .* outside the vocab"):
        model(torch.tensor([-1, 2]))


def test_prompt_longer_than_position_limit():
    model = tiny_model(max_position_embeddings=32)
    with tk.use("torch"), pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.zeros(33, dtype=torch.long))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.new_cache(1, 64)
    pages = PageAllocator(model.new_cache(1, 32))   # a slot's positions: max_seq_len <= 32
    slot = pages.add_sequence()
    with tk.use("torch"), torch.no_grad():
        extend(model, pages, torch.zeros(30, dtype=torch.long), [slot])
        with pytest.raises(CacheFullError, match="would reach 33 positions > max_seq_len 32"):
            extend(model, pages, torch.zeros(3, dtype=torch.long), [slot])
    assert pages.lengths[slot] == 30 and pages.used_pages == 2  # the failed call took nothing


def test_cache_capacity_exceeded():
    model = tiny_model()
    pages = PageAllocator(model.new_cache(1, 64, num_pages=1))  # one page = 16 positions
    slot = pages.add_sequence()
    with tk.use("torch"), torch.no_grad(), pytest.raises(CacheFullError, match="pages"):
        extend(model, pages, torch.zeros(20, dtype=torch.long), [slot])
    assert pages.lengths[slot] == 0 and pages.used_pages == 0


def test_bad_forward_arguments():
    model = tiny_model()
    ids = torch.zeros(6, dtype=torch.long)
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(ids, torch.tensor([0, 2, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="kv step holds"):   # 2 slots' steps, 1 sequence
        pages = PageAllocator(model.new_cache(2, 16))
        model(ids, kv=pages.prepare([pages.add_sequence(), pages.add_sequence()], [3, 3]))
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids.view(2, 3), attention_mask=torch.ones(3, 2))
    with pytest.raises(ValueError, match="at least one token"):
        model.token_logprobs([ids, ids[:0]])
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        Qwen3MoeForCausalLM(model.config, dtype=torch.float16)


@pytest.mark.parametrize("overrides, match", [
    (dict(num_key_value_heads=3), "not a multiple of num_key_value_heads"),
    (dict(hidden_size=60), "hidden_size=60 is not a multiple of reduction_chunks=8"),
    (dict(vocab_size=321), "vocab_size=321"),
    (dict(moe_intermediate_size=36), "moe_intermediate_size=36"),
    (dict(reduction_chunks=6), "power of two"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9"),
    (dict(mlp_only_layers=[7]), "mlp_only_layers"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
    (dict(use_sliding_window=True), "sliding_window"),
    (dict(head_dim=0), "head_dim"),
])
def test_inconsistent_config_raises(overrides, match):
    with pytest.raises(ValueError, match=match):
        Qwen3MoeConfig.preset("tiny", **overrides)
