"""tonp's layers inside megatron-core: a TransformerBlock built with the tonp spec gives the bits of
tonp's own model (padded [s, b, h], packed thd, KV-cached decode, TP=2 under megatron's
parallel_state on gloo); checkpoint conversion megatron-core <-> tonp <-> HF is bitwise both ways
and matches megatron's own layers' math; a megatron checkpoint converted to tonp scores its
generations with logdiff 0. Everything runs on CPU (megatron's own attention, router and rotary
embedding need CUDA: those paths are checked piecewise, see docs/megatron.md).
"""
import logging
import warnings

import pytest
import torch

import megatron.core  # noqa: E402,F401  (requirements-test.txt pins it: a broken install fails)
warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
logging.getLogger("megatron.core.transformer.transformer_layer").setLevel(logging.ERROR)

from megatron.core.inference.contexts import StaticInferenceContext  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.transformer_block import TransformerBlock  # noqa: E402

import tonp_kernels as tk  # noqa: E402
from conftest import assert_bitwise  # noqa: E402
from dist_utils import run_distributed  # noqa: E402
from model_helpers import packed, random_seqs, tiny_config, tiny_model  # noqa: E402
from tonp_models import Qwen3MoeForCausalLM, generate  # noqa: E402
from tonp_models.megatron import (check_transformer_config, get_tonp_block_spec,  # noqa: E402
                                  load_global_state_dict, qwen3_config_from_transformer,
                                  single_process_groups,
                                  transformer_config_from_qwen3)
from tonp_models.qwen3_moe import megatron_convert as mc  # noqa: E402


def _block(model, tc=None, pgs="single"):
    """A megatron TransformerBlock with the tonp spec holding `model`'s layer weights."""
    c = model.config
    tc = tc or transformer_config_from_qwen3(c)
    pgs = single_process_groups() if pgs == "single" else pgs
    spec = get_tonp_block_spec(tc, rotary_base=c.rope_theta,
                               max_position_embeddings=c.max_position_embeddings,
                               attention_block=c.attention_block,
                               reduction_chunks=c.reduction_chunks, pg_collection=pgs)
    block = TransformerBlock(tc, spec, pg_collection=pgs)
    return block


def _load(block, tonp_sd):
    """Global tonp weights into the block (sliced for this rank's TP/EP shards)."""
    missing, unexpected = load_global_state_dict(block, mc.tonp_to_spec(tonp_sd, block_only=True),
                                                 strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing,
                                                                                  unexpected)


def _logits(model, block, h_sbh, **kw):
    """embed -> megatron block -> tonp LM head; [s, b, h] in, fp32 logits [s, b, V] out."""
    return model.lm_head(block(h_sbh, attention_mask=kw.pop("attention_mask", None), **kw))


# ---------------------------------------------------------------------------------------------
# The block equals tonp's model
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mlp_only", "tied"])
def test_block_equals_tonp_model_bitwise_forward_and_backward(name):
    model = tiny_model(name)
    block = _block(model)
    _load(block, model.state_dict())
    seqs = random_seqs([9, 9, 9], model.config.vocab_size, seed=1)
    ids, cu = packed(seqs)
    ref = model(ids, cu)                                                       # (T, V)
    h = model.embed_tokens(torch.stack(seqs)).transpose(0, 1).contiguous()     # (s, b, h)
    got = _logits(model, block, h)                                             # (s, b, V)
    assert_bitwise(got.transpose(0, 1).reshape(ref.shape), ref, "megatron block vs tonp model")
    # The same math backwards; gradients are summed over tokens in megatron's [s, b] order
    # instead of tonp's [b, s] order, so they agree to rounding (CONTRACT.md: gradients must be
    # correct, not invariant).
    ref.square().mean().backward()
    got.transpose(0, 1).reshape(ref.shape).square().mean().backward()
    spec_grads = {k: p.grad for k, p in block.named_parameters()}
    tonp_grads = mc.tonp_to_spec({k: p.grad for k, p in model.named_parameters()
                                  if k.startswith(("layers.", "norm."))}, block_only=True)
    for k, g in tonp_grads.items():
        torch.testing.assert_close(spec_grads[k], g, rtol=1e-5, atol=1e-7, msg=k)


def test_packed_thd_sequences_equal_tonp_model():
    model = tiny_model("sparse_step2")
    block = _block(model)
    _load(block, model.state_dict())
    seqs = random_seqs([5, 17, 1, 11], model.config.vocab_size, seed=2)
    ids, cu = packed(seqs)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=17, max_seqlen_kv=17)
    h = model.embed_tokens(ids).unsqueeze(1)                                   # (T, 1, h)
    with torch.no_grad():
        got = _logits(model, block, h, packed_seq_params=params)[:, 0]
        assert_bitwise(got, model(ids, cu), "thd-packed block vs tonp model")


def _decode_vs_full(mode):
    """(cached prefill + one-token steps, full causal pass) logits [s, b, V], twice over one
    StaticInferenceContext (the second round restarts at offset 0: a new batch)."""
    model = tiny_model("mlp_only")
    block = _block(model).eval()
    _load(block, model.state_dict())
    seqs = random_seqs([20, 20], model.config.vocab_size, seed=3)
    ids, cu = packed(seqs)
    with torch.no_grad():
        full = model(ids, cu).view(2, 20, -1).transpose(0, 1)                  # (s, b, V)
        h = model.embed_tokens(torch.stack(seqs)).transpose(0, 1).contiguous()
        ctx = StaticInferenceContext(max_batch_size=2, max_sequence_length=32)
        rounds = []
        for _ in range(2):
            ctx.reset()
            outs = []
            for a, b in ((0, 13), (13, 14), (14, 17), (17, 18), (18, 19), (19, 20)):
                outs.append(_logits(model, block, h[a:b], inference_context=ctx))
                ctx.increment_sequence_len_offset(b - a)
            rounds.append(torch.cat(outs))
    return rounds, full


def test_static_inference_context_decode_equals_full_pass():
    """Megatron's StaticInferenceContext maps onto a tonp PagedKVCache: prefill then one-token
    steps give the logits of the full causal pass, bit for bit."""
    rounds, full = _decode_vs_full("invariant")
    for r in rounds:
        assert_bitwise(r, full, "cached prefill + decode vs full pass")


def test_static_inference_context_stock_torch_twin(torch_mode):
    """The same cached decode with stock torch kernels (SDPA, F.linear) drifts from the full
    pass: the bits above come from tonp's kernels, not from the test being lenient."""
    rounds, full = _decode_vs_full("torch")
    assert not torch.equal(rounds[0], full)


def test_refused_settings_and_masks_fail_clearly():
    c = tiny_config("mlp_only")
    bad = transformer_config_from_qwen3(c, add_bias_linear=True, qk_layernorm=False,
                                        moe_router_score_function="sigmoid",
                                        moe_aux_loss_coeff=0.01, window_size=(8, 0))
    with pytest.raises(ValueError) as e:
        check_transformer_config(bad)
    for field in ("add_bias_linear", "qk_layernorm", "moe_router_score_function",
                  "moe_aux_loss_coeff", "window_size"):
        assert field in str(e.value)
    with pytest.raises(ValueError, match="add_bias_linear"):
        get_tonp_block_spec(bad)
    model = tiny_model("mlp_only")
    block = _block(model)
    h = torch.randn(6, 2, model.config.hidden_size)
    pad = torch.ones(6, 6, dtype=torch.bool).triu(1).expand(2, 1, 6, 6).clone()
    pad[1, 0, :, 4:] = True                                 # a padding mask: refused
    with pytest.raises(ValueError, match="packed_seq_params"):
        block(h, attention_mask=pad)
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)[None, None]
    assert torch.equal(block(h, attention_mask=causal), block(h, attention_mask=None))
    # megatron's rotary_pos_emb ([s, 1, 1, d] angles) is checked against the spec's base
    def angles(base):
        inv = 1.0 / (base ** (torch.arange(0, 16, 2).float() / 16))
        f = torch.outer(torch.arange(6).float(), inv)
        return torch.cat((f, f), -1)[:, None, None, :]
    block(h, attention_mask=None, rotary_pos_emb=angles(model.config.rope_theta))
    with pytest.raises(ValueError, match="rotary_base"):
        _block(model)(h, attention_mask=None, rotary_pos_emb=angles(500000.0))


def test_config_maps_both_ways():
    for name in ("mlp_only", "sparse_step2", "tied"):
        c = tiny_config(name)
        tc = transformer_config_from_qwen3(c)
        back = qwen3_config_from_transformer(
            tc, vocab_size=c.vocab_size, rope_theta=c.rope_theta,
            max_position_embeddings=c.max_position_embeddings,
            tie_word_embeddings=c.tie_word_embeddings, attention_block=c.attention_block,
            reduction_chunks=c.reduction_chunks, bos_token_id=c.bos_token_id,
            eos_token_id=c.eos_token_id)
        layers = range(c.num_hidden_layers)
        assert [back.is_sparse_layer(i) for i in layers] == [c.is_sparse_layer(i) for i in layers]
        for f in ("hidden_size", "intermediate_size", "moe_intermediate_size",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts",
                  "num_experts_per_tok", "norm_topk_prob", "rms_norm_eps", "rope_theta"):
            assert getattr(back, f) == getattr(c, f), f


# ---------------------------------------------------------------------------------------------
# Checkpoint conversion
# ---------------------------------------------------------------------------------------------
LAYOUTS = [dict(), dict(fused_norms=True, experts="te_grouped"),
           dict(experts="legacy_grouped")]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["local", "te", "legacy_grouped"])
def test_round_trips_are_bitwise(layout):
    model = tiny_model("sparse_step2", dtype=torch.bfloat16)
    c, sd = model.config, model.state_dict()
    mcore = mc.tonp_to_megatron(sd, c, **layout)
    back = mc.megatron_to_tonp(mcore, c, **layout)
    assert back.keys() == sd.keys()
    for k in sd:
        assert_bitwise(back[k], sd[k], f"megatron -> tonp -> megatron: {k}")
    again = mc.tonp_to_megatron(back, c, **layout)
    for k in mcore:
        assert_bitwise(again[k], mcore[k], f"megatron round trip: {k}")
    hf = mc.tonp_to_hf(sd, c)
    hf2 = mc.megatron_to_hf(mc.hf_to_megatron(hf, c, **layout), c, **layout)
    assert hf2.keys() == hf.keys()
    for k in hf:
        assert_bitwise(hf2[k], hf[k], f"HF -> megatron -> HF: {k}")
    spec = mc.spec_to_tonp(mc.tonp_to_spec(sd))
    assert all(torch.equal(spec[k], sd[k]) for k in sd) and spec.keys() == sd.keys()


def test_conversion_errors_name_the_tensors():
    model = tiny_model("mlp_only")
    c = model.config
    mcore = mc.tonp_to_megatron(model.state_dict(), c)
    mcore.pop("decoder.layers.0.mlp.router.weight")
    mcore["decoder.layers.9.bogus.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="router.weight.*\n.*bogus"):
        mc.megatron_to_tonp(mcore, c)
    mcore = mc.tonp_to_megatron(model.state_dict(), c)
    mcore["decoder.layers.0.self_attention.linear_qkv.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="linear_qkv.weight has shape"):
        mc.megatron_to_tonp(mcore, c)


def test_megatron_checkpoint_converts_to_tonp_and_scores_with_logdiff_zero(spawned):
    c = MEGATRON_OWN_CONFIG
    sd, x, (q, k, v), mlp, expert = spawned[0]["own"]
    assert set(sd) == set(mc.tonp_to_megatron(tiny_model("mlp_only").state_dict(), c))
    model = Qwen3MoeForCausalLM(c)
    model.load_state_dict(mc.megatron_to_tonp(sd, c))
    # The converted weights compute megatron's own math (to rounding: different kernels).
    att, xs = model.layers[0].self_attn, x.reshape(10, -1)
    close = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(att.q_norm(att.q_proj(xs).view(10, 4, 16)), q.view(10, 4, 16),
                               **close)
    torch.testing.assert_close(att.k_norm(att.k_proj(xs).view(10, 2, 16)), k.view(10, 2, 16),
                               **close)
    torch.testing.assert_close(att.v_proj(xs).view(10, 2, 16), v.view(10, 2, 16), **close)
    with torch.no_grad():
        torch.testing.assert_close(model.layers[1].mlp(xs), mlp.view(10, -1), **close)
        moe = model.layers[0].mlp
        I = moe.intermediate
        gu = xs @ moe.gate_up_proj[3].T
        ref = (torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]) @ moe.down_proj[3].T
        torch.testing.assert_close(ref, expert, **close)
    # ... and tonp's rollout and training forward agree on it exactly.
    prompts = random_seqs([3, 8, 5], c.vocab_size, seed=4)
    with torch.no_grad():
        out = generate(model, prompts, max_new_tokens=6, temperature=1.0, seed=3)
        lps = model.token_logprobs(out.sequences)
    for p, seq, lp, roll in zip(prompts, out.sequences, lps, out.logprobs):
        logdiff = (lp[len(p) - 1:] - roll).abs().max().item()
        assert logdiff == 0.0 and torch.equal(lp[len(p) - 1:], roll)


# ---------------------------------------------------------------------------------------------
# Spawned: one 2-rank gloo run (process start-up and megatron's import cost seconds) does the
# work that needs torch.distributed; the tests compare its results.
# ---------------------------------------------------------------------------------------------
MEGATRON_OWN_CONFIG = tiny_config("mlp_only", initializer_range=0.08)


def _megatron_own_model(config):
    """megatron's own local-spec GPTModel (CPU init, parallel_state at TP 1) and the outputs
    of its CPU-capable pieces (qkv projection + split + QK norms, dense MLP, one expert)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    tc = transformer_config_from_qwen3(config, init_method_std=0.08)
    torch.manual_seed(5)
    spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization="RMSNorm")
    m = GPTModel(tc, spec, vocab_size=config.vocab_size,
                 max_sequence_length=config.max_position_embeddings,
                 position_embedding_type="rope", rotary_base=int(config.rope_theta))
    x = torch.randn(5, 2, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        qkv = m.decoder.layers[0].self_attention.get_query_key_value_tensors(x, None)
        mlp = m.decoder.layers[1].mlp(x)[0]
        expert = m.decoder.layers[0].mlp.experts.local_experts[3](x.view(10, -1))[0]
    sd = {k: v for k, v in m.state_dict().items() if not k.endswith("_extra_state")}
    return sd, x, [t.contiguous() for t in qkv], mlp, expert


def _layout(mode, tp=1, ep=1, name="mlp_only", **ps_kw):
    """Under megatron's parallel_state at (tp, ep): the tonp-spec block's logits next to the TP-1
    model's, this rank's expert range, and megatron's dist-checkpointing view of the shards
    (megatron's own integrity check: every global tensor covered once; each shard's bytes
    against the global tensor's region)."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.validation import (determine_global_metadata,
                                                             validate_sharding_integrity)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 **ps_kw)
    with tk.use(mode):
        model = tiny_model(name)                              # TP 1, the same weights on each rank
        tc = transformer_config_from_qwen3(model.config, tensor_model_parallel_size=tp,
                                           expert_model_parallel_size=ep, **ps_kw)
        block = _block(model, tc, pgs=None)                   # groups from parallel_state
        _load(block, model.state_dict())
        seqs = random_seqs([9, 9], model.config.vocab_size, seed=6)
        ids, cu = packed(seqs)
        with torch.no_grad():
            ref = model(ids, cu)
            h = model.embed_tokens(torch.stack(seqs)).transpose(0, 1).contiguous()
            got = _logits(model, block, h).transpose(0, 1).reshape(ref.shape)
        sharded = block.sharded_state_dict()
        validate_sharding_integrity(determine_global_metadata(sharded)[1])  # raises on rank 0
        full = mc.tonp_to_spec(model.state_dict(), block_only=True)
        wrong = []
        for k, st in sharded.items():
            if isinstance(st, ShardedTensor):
                region = tuple(slice(o, o + n) for o, n in zip(st.global_offset, st.local_shape))
                if tuple(full[k].shape) != st.global_shape or not torch.equal(full[k][region],
                                                                              st.data):
                    wrong.append(k)
        moe = block.layers[0].mlp
        out = dict(got=got, ref=ref, wrong=wrong, heads=block.layers[0].self_attention.local_heads,
                   experts=(moe.first_expert, moe.local_experts),
                   shapes={k: tuple(sharded[k].global_shape) for k in SHAPE_KEYS if k in sharded})
    ps.destroy_model_parallel()
    return out


SHAPE_KEYS = ("layers.0.self_attention.q_proj.weight", "layers.0.self_attention.k_proj.weight",
              "layers.0.self_attention.o_proj.weight", "layers.1.mlp.down_proj.weight",
              "layers.0.mlp.gate_up_proj")
GLOBAL_SHAPES = {"layers.0.self_attention.q_proj.weight": (64, 64),
                 "layers.0.self_attention.k_proj.weight": (32, 64),
                 "layers.0.self_attention.o_proj.weight": (64, 64),
                 "layers.1.mlp.down_proj.weight": (64, 128),
                 "layers.0.mlp.gate_up_proj": (8, 64, 64)}
LAYOUTS = {"tp2": dict(tp=2), "ep2": dict(ep=2, expert_tensor_parallel_size=1),
           "tp2_ep2": dict(tp=2, ep=2, expert_tensor_parallel_size=1)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_megatron_parallel_layout_equals_tp1(spawned, layout):
    """TP 2, EP 2 and TP 2 x EP 2 under megatron's parallel_state: the tonp-spec block gives the
    TP-1 model's logits bit for bit; each EP rank holds its contiguous half of the experts."""
    tp, ep = LAYOUTS[layout].get("tp", 1), LAYOUTS[layout].get("ep", 1)
    for rank, r in enumerate(spawned):
        r = r[layout]
        assert r["heads"] == 4 // tp
        assert r["experts"] == ((rank % ep) * 8 // ep, 8 // ep)
        assert_bitwise(r["got"], r["ref"], f"{layout} rank {rank} vs TP=1")


@pytest.mark.parametrize("layout", [*LAYOUTS, "kv_copies"])
def test_dist_checkpointing_sees_each_shard_in_its_global_tensor(spawned, layout):
    """megatron's `sharded_state_dict` of the tonp layers: global shapes, each rank's slice at its
    offset (TP heads, EP expert ranges, KV heads copied over TP ranks), every global tensor
    covered exactly once by main replicas (megatron's validate_sharding_integrity)."""
    for rank, r in enumerate(spawned):
        r = r[layout]
        assert r["wrong"] == [], f"{layout} rank {rank}: shards off their global region"
        want = dict(GLOBAL_SHAPES)
        if layout == "kv_copies":   # the "tied" config: one KV head, every layer sparse
            want["layers.0.self_attention.k_proj.weight"] = (16, 64)
            del want["layers.1.mlp.down_proj.weight"]
        assert r["shapes"] == want, r["shapes"]


def test_expert_tensor_parallelism_is_refused(spawned):
    """tonp keeps each expert whole: an expert-TP group of 2 under EP is refused by name."""
    assert "expert tensor parallelism must be 1" in spawned[0]["expert_tp"]


def test_tp2_stock_torch_twin(spawned):
    """Stock torch (F.linear per shard + gloo's all_reduce) does not give TP=1's bits."""
    r = spawned[0]["tp2_torch"]
    assert not torch.equal(r["got"], r["ref"])


def _refused_expert_tp():
    """A TonpSparseMoE given an EP group and an expert-TP group of 2 ranks each."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection
    from tonp_models.megatron import TonpSparseMoE
    world = dist.group.WORLD
    pgs = ProcessGroupCollection(tp=None, ep=world, expt_tp=world, dp=None, dp_cp=None,
                                 expt_dp=None)
    try:
        TonpSparseMoE(transformer_config_from_qwen3(tiny_config("mlp_only")), pg_collection=pgs)
    except ValueError as e:
        return str(e)
    return "not refused"


def _rank_main():
    from megatron.core import parallel_state as ps
    out = {name: _layout("invariant", **kw) for name, kw in LAYOUTS.items()}
    out["kv_copies"] = _layout("invariant", tp=2, name="tied")     # 1 KV head on 2 TP ranks
    out["tp2_torch"] = _layout("torch", tp=2)
    out["expert_tp"] = _refused_expert_tp()
    ps.initialize_model_parallel(1, 1)                        # now TP 1 (DP 2)
    if ps.get_data_parallel_rank() == 0:
        out["own"] = _megatron_own_model(MEGATRON_OWN_CONFIG)
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def spawned():
    return run_distributed(_rank_main, 2, timeout=300)
