"""HF checkpoints round-trip both ways, through the one name/shard table.

tonp save -> transformers from_pretrained gives the same tensors and logits; transformers
save_pretrained -> tonp load gives the same tensors (bitwise) and logits; sharded checkpoints
with an index and transformers' fused-expert layout load; mismatches raise one error that lists
every missing, unexpected and mis-shaped tensor. Configs read both transformers 4 and 5 spellings.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import tonp_kernels as tk
from tonp_models import Qwen3MoeConfig, Qwen3MoeForCausalLM
from tonp_models.qwen3_moe.checkpoint import TABLE, hub_slots, state_dict_hub
from model_helpers import hf_twin, random_seqs, tiny_model


def _params_equal(a, b):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for k in pa:
        assert pa[k].dtype == pb[k].dtype and torch.equal(pa[k], pb[k]), k


def _hf_state(hf):
    """transformers' in-memory weights under hub names (fused experts split per expert)."""
    out = {}
    for k, v in hf.state_dict().items():
        if k.endswith("mlp.experts.gate_up_proj"):
            prefix, I = k[:-len("gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = v[e, :I]
                out[f"{prefix}{e}.up_proj.weight"] = v[e, I:]
        elif k.endswith("mlp.experts.down_proj"):
            for e in range(v.shape[0]):
                out[f"{k[:-len('down_proj')]}{e}.down_proj.weight"] = v[e]
        else:
            out[k] = v
    return out


@pytest.mark.parametrize("name", ["mlp_only", "tied", "sparse_step2"])
def test_tonp_save_transformers_load(name, tmp_path):
    model = tiny_model(name)
    hf = hf_twin(model, tmp_path)                         # tonp save_pretrained -> HF load
    ours = state_dict_hub(model)
    theirs = _hf_state(hf)
    if model.config.tie_word_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
        theirs.pop("lm_head.weight", None)
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k
    s = random_seqs([17], model.config.vocab_size)[0]
    with tk.use("torch"), torch.no_grad():
        torch.testing.assert_close(model(s), hf(s[None]).logits[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformers_save_tonp_load(dtype, tmp_path):
    import transformers
    model = tiny_model("sparse_step2", dtype=dtype)
    hf_cfg = transformers.Qwen3MoeConfig(**{k: v for k, v in model.config.to_hf().items()
                                            if k not in ("attention_block", "reduction_chunks")})
    torch.manual_seed(3)
    hf = transformers.Qwen3MoeForCausalLM(hf_cfg).to(dtype).eval()
    hf.save_pretrained(tmp_path / "hf")
    loaded = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.dtype == dtype
    ours = state_dict_hub(loaded)
    for k, v in _hf_state(hf).items():
        assert torch.equal(ours[k], v), k
    if dtype == torch.float32:
        s = random_seqs([21], loaded.config.vocab_size)[0]
        with tk.use("torch"), torch.no_grad():
            torch.testing.assert_close(loaded(s), hf(s[None]).logits[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sharded_round_trip_is_bitwise(dtype, tmp_path):
    model = tiny_model("mlp_only", dtype=dtype)
    model.save_pretrained(tmp_path, max_shard_size=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    _params_equal(Qwen3MoeForCausalLM.from_pretrained(tmp_path), model)


def test_fused_expert_layout_loads(tmp_path):
    """transformers' in-memory layout (mlp.experts.gate_up_proj / down_proj) loads too."""
    model = tiny_model("mlp_only")
    model.save_pretrained(tmp_path / "hub")
    hf = hf_twin(model, tmp_path)
    (tmp_path / "fused").mkdir()
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "hub" / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()},
              str(tmp_path / "fused" / "model.safetensors"))
    assert any(k.endswith("mlp.experts.gate_up_proj")
               for k in load_file(str(tmp_path / "fused" / "model.safetensors")))
    _params_equal(Qwen3MoeForCausalLM.from_pretrained(tmp_path / "fused"), model)


def test_mismatched_checkpoint_lists_every_problem(tmp_path):
    model = tiny_model("mlp_only")
    model.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    tensors["model.layers.0.mlp.shared_expert.weight"] = torch.zeros(2)
    tensors["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError) as e:
        Qwen3MoeForCausalLM.from_pretrained(tmp_path)
    msg = str(e.value)
    for s in ("missing (2)", "self_attn.k_proj", "experts.3.up_proj", "unexpected (1)",
              "shared_expert", "mis-shaped (1)", "layers.1.mlp.down_proj.weight: checkpoint "
              "[64, 64], model [64, 128]"):
        assert s in msg, (s, msg)


def test_checkpoint_of_another_shape_is_refused(tmp_path):
    tiny_model("mlp_only", num_experts=4).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_experts"] = 8
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"(?s)missing \(24\).*experts\.4\.gate_proj.*"
                                         r"mis-shaped \(2\).*mlp\.gate\.weight"):
        Qwen3MoeForCausalLM.from_pretrained(tmp_path)
    cfg["num_local_experts"] = 4
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="disagree"):
        Qwen3MoeForCausalLM.from_pretrained(tmp_path)


def test_table_covers_every_parameter():
    """Each tonp parameter is filled exactly once by the table's slots (no gaps, no overlap)."""
    for name in ("mlp_only", "tied", "sparse_step2"):
        model = tiny_model(name)
        cover = {k: torch.zeros_like(p, dtype=torch.int32) for k, p in model.named_parameters()}
        for s in hub_slots(model):
            region = cover[s.param][s.index] if s.index else cover[s.param]
            region += 1
        for k, c in cover.items():
            assert bool((c == 1).all()), f"{name}: {k} covered {c.min()}..{c.max()} times"
    assert len({row[0] for row in TABLE}) == len(TABLE)


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------
def test_config_reads_transformers_4_and_5_spellings():
    v5 = dict(model_type="qwen3_moe", num_local_experts=8, dtype="bfloat16",
              rope_parameters={"rope_type": "default", "rope_theta": 5e5}, vocab_size=320,
              hidden_size=64, intermediate_size=128, moe_intermediate_size=32, head_dim=16,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, architectures=["Qwen3MoeForCausalLM"], use_cache=True)
    v4 = {**{k: v for k, v in v5.items() if k not in ("num_local_experts", "dtype",
                                                      "rope_parameters")},
          "num_experts": 8, "torch_dtype": "bfloat16", "rope_theta": 5e5, "rope_scaling": None,
          "max_window_layers": 48, "sliding_window": None, "use_sliding_window": False}
    a, b = Qwen3MoeConfig.from_hf(v5), Qwen3MoeConfig.from_hf(v4)
    assert a == b and a.num_experts == 8 and a.rope_theta == 5e5 and a.dtype == torch.bfloat16
    assert Qwen3MoeConfig.from_hf(a.to_hf()) == a


def test_config_from_transformers_config_json(tmp_path):
    import transformers
    cfg = Qwen3MoeConfig.preset("tiny")
    hf = transformers.Qwen3MoeConfig(**{k: v for k, v in cfg.to_hf().items()
                                        if k not in ("attention_block", "reduction_chunks")})
    hf.save_pretrained(tmp_path)
    back = Qwen3MoeConfig.from_hf(tmp_path, attention_block=cfg.attention_block)
    assert back == cfg


@pytest.mark.parametrize("bad, match", [
    (dict(some_new_knob=1), r"unknown or unsupported keys \['some_new_knob'\]"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}),
     "rope_scaling"),
    (dict(model_type="llama"), "model_type"),
    (dict(attention_dropout=0.1), "attention_dropout"),
])
def test_config_refuses_unsupported_settings(bad, match):
    base = Qwen3MoeConfig.preset("tiny").to_hf()
    with pytest.raises(ValueError, match=match):
        Qwen3MoeConfig.from_hf({**base, **bad})


def test_presets():
    big = Qwen3MoeConfig.preset("qwen3_30b_a3b")
    assert (big.num_experts, big.num_experts_per_tok, big.num_hidden_layers) == (128, 8, 48)
    assert Qwen3MoeConfig.preset("qwen3_235b_a22b").hidden_size == 4096
    assert Qwen3MoeConfig.preset("tiny", num_hidden_layers=2).num_hidden_layers == 2
    with pytest.raises(KeyError, match="unknown preset"):
        Qwen3MoeConfig.preset("gpt5")
