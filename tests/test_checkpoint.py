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
    for name, kw in (("mlp_only", {}), ("tied", {}), ("sparse_step2", {}),
                     ("mlp_only", dict(attention_bias=True))):
        model = tiny_model(name, **kw)
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
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
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


def test_attention_bias_round_trips_through_transformers(tmp_path):
    """attention_bias=True: q/k/v/o biases are in the table, so transformers reads them."""
    model = tiny_model("mlp_only", attention_bias=True)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0.0, 0.1)
    hf = hf_twin(model, tmp_path)
    s = random_seqs([13], model.config.vocab_size)[0]
    with tk.use("torch"), torch.no_grad():
        torch.testing.assert_close(model(s), hf(s[None]).logits[0], rtol=1e-4, atol=1e-5)
    _params_equal(Qwen3MoeForCausalLM.from_pretrained(tmp_path / "hf_twin"), model)


# ---------------------------------------------------------------------------------------------
# Saving over an existing checkpoint
# ---------------------------------------------------------------------------------------------
def _entries(path):
    return sorted(p.name for p in path.iterdir())


@pytest.mark.parametrize("first, second", [(40_000, None), (None, 40_000)],
                         ids=["sharded_then_single", "single_then_sharded"])
def test_save_over_a_checkpoint_leaves_exactly_the_new_one(first, second, tmp_path):
    """The second save replaces the first as a whole: no stale index or shard is left for
    tonp or transformers to read; files that are not weights (a tokenizer) are kept."""
    import transformers
    old, new = tiny_model("mlp_only", seed=1), tiny_model("mlp_only", seed=2)
    kw = lambda size: {} if size is None else dict(max_shard_size=size)  # noqa: E731
    old.save_pretrained(tmp_path / "ckpt", **kw(first))
    (tmp_path / "ckpt" / "tokenizer.json").write_text("{}")
    new.save_pretrained(tmp_path / "ckpt", **kw(second))
    names = _entries(tmp_path / "ckpt")
    if second is None:
        assert names == ["config.json", "model.safetensors", "tokenizer.json"]
    else:
        assert "model.safetensors" not in names and "model.safetensors.index.json" in names
    assert _entries(tmp_path) == ["ckpt"]                          # no temporary directory left
    _params_equal(Qwen3MoeForCausalLM.from_pretrained(tmp_path / "ckpt"), new)
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "ckpt")
    theirs = _hf_state(hf)
    for k, v in state_dict_hub(new).items():
        assert torch.equal(theirs[k], v), k


def test_save_refuses_weight_files_it_did_not_write(tmp_path):
    old = tiny_model("mlp_only", seed=1)
    old.save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not ours")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match=r"pytorch_model\.bin"):
        tiny_model("mlp_only", seed=2).save_pretrained(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_failed_save_leaves_the_old_checkpoint(tmp_path, monkeypatch):
    import safetensors.torch
    old = tiny_model("mlp_only", seed=1)
    old.save_pretrained(tmp_path / "ckpt", max_shard_size=40_000)
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}
    calls = []

    def fail_on_second_file(*args, **kw):
        calls.append(args[1])
        if len(calls) == 2:
            raise OSError("disk full")
        return save_file(*args, **kw)
    monkeypatch.setattr(safetensors.torch, "save_file", fail_on_second_file)
    with pytest.raises(OSError, match="disk full"):
        tiny_model("mlp_only", seed=2).save_pretrained(tmp_path / "ckpt", max_shard_size=40_000)
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == before
    assert _entries(tmp_path) == ["ckpt"]


# ---------------------------------------------------------------------------------------------
# Ambiguous or damaged checkpoint directories are refused by name
# ---------------------------------------------------------------------------------------------
def _saved(tmp_path, dtype=torch.float32, **kw):
    """A saved tiny checkpoint dir and its tensors (hub names)."""
    model = tiny_model("mlp_only", dtype=dtype)
    model.save_pretrained(tmp_path, **kw)
    return model, load_file(str(tmp_path / "model.safetensors")) if not kw else None


def test_a_tensor_in_two_files_is_refused(tmp_path):
    _, tensors = _saved(tmp_path)
    name = "model.layers.0.self_attn.q_proj.weight"
    save_file({name: tensors[name]}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(ValueError, match=rf"{name} is defined in both .*extra\.safetensors.*"
                                         rf"model\.safetensors"):
        Qwen3MoeForCausalLM.from_pretrained(tmp_path)


def test_an_index_beside_a_single_file_is_refused(tmp_path):
    _saved(tmp_path / "a", max_shard_size=40_000)
    _saved(tmp_path / "b")
    for f in (tmp_path / "b").iterdir():
        (tmp_path / "a" / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ValueError, match="both model.safetensors and model.safetensors.index"):
        Qwen3MoeForCausalLM.from_pretrained(tmp_path / "a")


def test_fused_and_per_expert_tensors_of_one_layer_are_refused(tmp_path):
    model, tensors = _saved(tmp_path)
    tensors["model.layers.0.mlp.experts.gate_up_proj"] = model.layers[0].mlp.gate_up_proj.data
    tensors["model.layers.0.mlp.experts.down_proj"] = model.layers[0].mlp.down_proj.data
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layer 0 has both fused \(model\.layers\.0\.mlp\."
                                         r"experts\.gate_up_proj in .*\) and per-expert"):
        Qwen3MoeForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("target", ["../outside.safetensors", "/tmp/abs.safetensors",
                                    "sub/../../x.safetensors"])
def test_index_entries_outside_the_directory_are_refused(target, tmp_path):
    _saved(tmp_path, max_shard_size=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = target
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"maps {name} to '{target}', outside"):
        Qwen3MoeForCausalLM.from_pretrained(tmp_path)


def test_dtype_casts_are_exact_and_logged_or_refused(tmp_path, caplog):
    """fp16 -> fp32 is exact (loaded, logged); fp16 -> bf16 and int64 -> float are refused,
    naming the tensor and its file; fp32 -> bf16 is the bf16 model's own rounding."""
    model, tensors = _saved(tmp_path)
    name = "model.layers.0.self_attn.q_proj.weight"
    half = {k: (v.half() if k == name else v) for k, v in tensors.items()}
    save_file(half, str(tmp_path / "model.safetensors"))
    with caplog.at_level("INFO", logger="tonp_models.qwen3_moe.checkpoint_files"):
        loaded = Qwen3MoeForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(loaded.layers[0].self_attn.q_proj.weight, half[name].float())
    assert "1 tensors converted torch.float16 -> torch.float32 (exact)" in caplog.text
    with pytest.raises(ValueError, match=rf"{name} in .*model\.safetensors is torch\.float16, "
                                         rf"the model is torch\.bfloat16.*dtype=torch\.float32"):
        Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    save_file({**tensors, name: tensors[name].long()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"wrong dtype \(1\): {name} .* is I64"):
        Qwen3MoeForCausalLM.from_pretrained(tmp_path)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    bf16 = Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert torch.equal(bf16.layers[0].self_attn.q_proj.weight, tensors[name].bfloat16())


def test_non_finite_weights_are_refused(tmp_path):
    _, tensors = _saved(tmp_path)
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name][3, 5] = float("nan")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"non-finite \(1\): {name} in .*: 1 NaN / inf"):
        Qwen3MoeForCausalLM.from_pretrained(tmp_path)


# ---------------------------------------------------------------------------------------------
# Config values that used to fail only at the first forward
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key, value, match", [
    ("tie_word_embeddings", "false", "tie_word_embeddings='false' must be a bool"),
    ("num_experts", 8.0, "num_experts=8.0 must be an int"),
    ("num_experts_per_tok", True, "num_experts_per_tok=True must be a positive int"),
    ("rms_norm_eps", float("nan"), "rms_norm_eps=nan must be a finite number > 0"),
    ("rope_theta", float("nan"), "rope_theta=nan must be a finite number > 0"),
    ("rope_scaling", {"factor": 2.0}, r"rope_scaling=\{'factor': 2.0\} is not supported"),
    ("head_dim", 12, "head_dim=12 must be a multiple of 8"),
    ("reduction_chunks", 128, "reduction_chunks=128 must be a power of two in"),
    ("hidden_size", -64, "hidden_size=-64 must be a positive int"),
    ("vocab_size", 0, "vocab_size=0 must be a positive int"),
    ("eos_token_id", -1, "eos_token_id=-1 must be a token id"),
])
def test_config_json_values_are_refused_by_name(key, value, match, tmp_path):
    """Each value raises at Qwen3MoeConfig(...) and at from_hf (a config.json), not later."""
    base = Qwen3MoeConfig.preset("tiny").to_hf()
    base.pop("rope_parameters")
    (tmp_path / "config.json").write_text(json.dumps({**base, key: value}))
    with pytest.raises(ValueError, match=match):
        Qwen3MoeConfig.from_hf(tmp_path)
    with pytest.raises(ValueError, match=match):
        Qwen3MoeConfig.preset("tiny", **{key: value})


def test_config_json_errors_name_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        Qwen3MoeConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a JSON list, not an object"):
        Qwen3MoeConfig.from_hf(tmp_path)


def test_missing_config_keys_mean_what_transformers_reads():
    """A config.json without head_dim, norm_topk_prob, rope_theta, ...: tonp takes
    transformers' defaults (hidden / heads, False, 10000, ...), not its own preset values."""
    import transformers
    d = dict(model_type="qwen3_moe", vocab_size=320, hidden_size=64, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=128, moe_intermediate_size=32,
             num_experts=8, num_experts_per_tok=2)
    ours, theirs = Qwen3MoeConfig.from_hf(d), transformers.Qwen3MoeConfig(**d)
    hf_attn = transformers.Qwen3MoeForCausalLM(theirs).model.layers[0].self_attn
    assert ours.head_dim == hf_attn.head_dim == 16
    for k in ("num_hidden_layers", "max_position_embeddings", "norm_topk_prob", "rms_norm_eps",
              "decoder_sparse_step", "tie_word_embeddings"):
        assert getattr(ours, k) == getattr(theirs, k), k
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
