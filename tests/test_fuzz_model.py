"""Fuzzing two public entry points: `model(...)` (forward) and `from_pretrained`.

Seeded random cases, each either equivalent to a valid call (then the result must be the
reference's bits: per-sequence forwards, the full pass for a cached step, the saved weights)
or invalid (then a ValueError / TypeError / IndexError / FileNotFoundError whose message names
the argument, tensor or file). Never another exception, a NaN, or a cache left changed by a
refused call. A few seconds.
"""
from __future__ import annotations

import json
import random
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import tonp_kernels as tk
from model_helpers import tiny_model
from tonp_models import Qwen3MoeConfig, Qwen3MoeForCausalLM
from tonp_models.engine import PageAllocator, extend
from tonp_models.layers import CacheFullError, PagedKVCache
from tonp_models.qwen3_moe.checkpoint import state_dict_hub

CLEAN = (ValueError, TypeError, IndexError, FileNotFoundError, CacheFullError)
FORWARD_CASES, LOAD_CASES, CONFIG_CASES = 80, 40, 120


def _clean_error(fn, pattern: str):
    """fn() must raise a clean error whose message matches `pattern`."""
    try:
        out = fn()
    except CLEAN as e:
        assert re.search(pattern, str(e)), f"{type(e).__name__} does not name {pattern!r}: {e}"
        return
    except Exception as e:  # noqa: BLE001 -- anything else is the failure this test looks for
        raise AssertionError(f"crashed with {type(e).__name__}: {e}") from e
    raise AssertionError(f"accepted an invalid call (expected an error naming {pattern!r}); "
                         f"returned {type(out).__name__}")


# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return tiny_model("mlp_only", num_hidden_layers=2, max_position_embeddings=48).eval()


def _reference(model, seqs):
    """Each sequence alone, whole: the logits every arrangement must reproduce."""
    return [model(s) for s in seqs]


def _packed_case(rng: random.Random, model, seqs, ref):
    """A packed call, maybe mutated: (kwargs, None) with the expected logits, or (kwargs,
    pattern) for a call that must fail."""
    V, T = model.config.vocab_size, sum(len(s) for s in seqs)
    ids, bounds = torch.cat(seqs), [0]
    for s in seqs:
        bounds.append(bounds[-1] + len(s))
    kw = dict(input_ids=ids, cu_seqlens=torch.tensor(bounds, dtype=torch.int32))
    want = torch.cat(ref)
    kind = rng.choice(["ok_int32", "ok_list", "ok_cu_int64", "ok_rows", "float_ids", "bool_ids",
                       "vocab", "ids_0d", "ids_3d", "cu_float", "cu_end", "cu_fall", "cu_wrap",
                       "cu_2d", "rows_range", "rows_float", "rows_2d", "mask_packed",
                       "too_long"])
    if kind == "ok_int32":
        kw["input_ids"] = ids.int()
    elif kind == "ok_list":
        kw.update(input_ids=ids.tolist(), cu_seqlens=bounds)
    elif kind == "ok_cu_int64":
        kw["cu_seqlens"] = torch.tensor(bounds)
    elif kind == "ok_rows":
        rows = sorted(rng.sample(range(T), rng.randint(1, T)))
        kw["logits_rows"], want = torch.tensor(rows), want[rows]
    elif kind in ("float_ids", "bool_ids"):
        kw["input_ids"] = ids.float() if kind == "float_ids" else ids > V // 2
        return kw, "input_ids must be an integer tensor"
    elif kind == "vocab":
        bad = ids.clone()
        bad[rng.randrange(T)] = rng.choice([V, -1, 2**40])
        kw["input_ids"] = bad
        return kw, "input_ids holds token ids .* outside the vocabulary"
    elif kind in ("ids_0d", "ids_3d"):
        kw.update(input_ids=ids[0] if kind == "ids_0d" else ids.view(1, 1, T), cu_seqlens=None)
        return kw, "input_ids must be"
    elif kind == "cu_float":
        kw["cu_seqlens"] = torch.tensor(bounds, dtype=torch.float32) + 0.5
        return kw, "cu_seqlens must be an integer tensor"
    elif kind.startswith("cu_"):
        bad = list(bounds)
        if kind == "cu_end":
            bad[-1] += rng.choice([-1, 1])
        elif kind == "cu_fall" and len(bad) > 2:
            bad[1] = bad[-1] + 1
        elif kind == "cu_wrap":
            bad[-1] += 2**32                 # int32 would wrap this back to T
        else:
            bad = [bad]
        kw["cu_seqlens"] = torch.tensor(bad)
        return kw, "cu_seqlens must be 1-D, rise from 0"
    elif kind == "rows_range":
        kw["logits_rows"] = torch.tensor([rng.choice([-1, T, T + 7])])
        return kw, "logits_rows"
    elif kind in ("rows_float", "rows_2d"):
        kw["logits_rows"] = torch.tensor([0.0, 1.5]) if kind == "rows_float" \
            else torch.tensor([[0, 1]])
        return kw, "logits_rows must be"
    elif kind == "mask_packed":
        kw["attention_mask"] = torch.ones(T)
        return kw, "attention_mask"
    elif kind == "too_long":
        kw.update(input_ids=torch.zeros(49, dtype=torch.long), cu_seqlens=None)
        return kw, "max_position_embeddings=48"
    return kw, want


def _padded_case(rng: random.Random, model, seqs, ref):
    """A padded [B, L] call: each row's tokens left- or right-aligned under a 0/1 mask."""
    B, L = len(seqs), max(len(s) for s in seqs)
    ids = torch.randint(0, model.config.vocab_size, (B, L), generator=torch.Generator()
                        .manual_seed(rng.randrange(2**31)))
    mask = torch.zeros(B, L, dtype=torch.long)
    want = torch.zeros(B, L, model.config.vocab_size)
    for i, (s, r) in enumerate(zip(seqs, ref)):
        start = rng.choice([0, L - len(s)])
        ids[i, start:start + len(s)], mask[i, start:start + len(s)] = s, 1
        want[i, start:start + len(s)] = r
    kw = dict(input_ids=ids, attention_mask=mask)
    kind = rng.choice(["ok_long", "ok_bool", "ok_float", "ok_none", "mask_shape", "mask_values",
                       "mask_list", "cu_with_padded", "float_ids"])
    if kind == "ok_bool":
        kw["attention_mask"] = mask.bool()
    elif kind == "ok_float":
        kw["attention_mask"] = mask.float()
    elif kind == "ok_none":
        kw["input_ids"] = torch.stack([s[:1].repeat(L) for s in seqs])
        kw.pop("attention_mask")
        want = torch.stack([model(row) for row in kw["input_ids"]])
    elif kind == "mask_shape":
        kw["attention_mask"] = mask[:, :-1] if L > 1 else mask.T
        return kw, "attention_mask .* does not match input_ids"
    elif kind == "mask_values":
        kw["attention_mask"] = mask * rng.choice([2, 0.5])
        return kw, "attention_mask must hold only 0"
    elif kind == "mask_list":
        kw["attention_mask"] = mask.tolist()
        return kw, "attention_mask must be a tensor"
    elif kind == "cu_with_padded":
        kw["cu_seqlens"] = torch.tensor([0, B * L])
        return kw, "padded"
    elif kind == "float_ids":
        kw["input_ids"] = ids.double()
        return kw, "input_ids must be an integer tensor"
    return kw, want


def _cached_case(rng: random.Random, model, seqs, ref):
    """A prefix of every sequence in the cache, then the rest in one call (`extend`: the
    allocator prepares the pages, the model runs, the allocator commits): the rest's logits are
    the full pass's rows. Invalid variants must leave the cache as it was."""
    pages = PageAllocator(model.new_cache(len(seqs), 48))
    slots = [pages.add_sequence() for _ in seqs]
    cut = [rng.randint(0, len(s) - 1) for s in seqs]
    pre = [s[:c] for s, c in zip(seqs, cut)]
    extend(model, pages, torch.cat(pre), slots,
           torch.tensor([0, *torch.tensor(cut).cumsum(0).tolist()]))
    rest = [s[c:] for s, c in zip(seqs, cut)]
    bounds = [0, *torch.tensor([len(r) for r in rest]).cumsum(0).tolist()]
    kw = dict(ids=torch.cat(rest), cu_seqlens=torch.tensor(bounds), pages=pages, slots=slots,
              unchanged=pages)
    want = torch.cat([r[c:] for r, c in zip(ref, cut)])
    kind = rng.choice(["ok", "ok_tensor_slots", "slot_range", "slot_dup", "slot_float",
                       "slot_count", "not_a_step", "page_size", "cache_dtype", "past_limit"])
    if kind == "ok_tensor_slots":
        kw["slots"] = torch.tensor(slots)
    elif kind == "slot_range":
        kw["slots"] = [rng.choice([-1, len(seqs), 99])] + slots[1:]
        return kw, "slots .* must be distinct slots"
    elif kind == "slot_dup" and len(slots) > 1:
        kw["slots"] = [slots[0]] * len(slots)
        return kw, "slots .* must be distinct slots"
    elif kind == "slot_float":
        kw["slots"] = [s + 0.5 for s in slots]
        return kw, "slots and counts must be integers"
    elif kind == "slot_count":
        kw["slots"] = slots + [len(slots)]
        return kw, "slots"
    elif kind == "not_a_step":
        kw = dict(input_ids=kw["ids"], cu_seqlens=kw["cu_seqlens"], kv={"lengths": [0]},
                  unchanged=pages)
        return kw, "kv must be a CacheStep"
    elif kind in ("page_size", "cache_dtype"):
        c = model.config
        kw["pages"] = PageAllocator(PagedKVCache(
            c.num_hidden_layers, c.num_key_value_heads, c.head_dim, num_pages=16,
            page_size=c.attention_block // (2 if kind == "page_size" else 1), max_seqs=len(seqs),
            max_seq_len=48, dtype=model.dtype if kind == "page_size" else
            {torch.float32: torch.bfloat16, torch.bfloat16: torch.float32}[model.dtype]))
        return kw, "the cache holds"
    elif kind == "past_limit":
        n = 48 - cut[0] + 1                  # one position past the limit for slot 0
        kw["ids"] = torch.zeros(n, dtype=torch.long)
        kw["cu_seqlens"] = torch.tensor([0] + [n] * len(seqs))
        return kw, "would reach .* > max_seq_len 48"
    return kw, want


def _call(model, kw: dict):
    """The model on kw, through `extend` when kw names an allocator and slots."""
    kw = {k: v for k, v in kw.items() if k != "unchanged"}
    if "pages" in kw:
        return extend(model, kw["pages"], kw["ids"], kw["slots"], kw["cu_seqlens"])
    return model(**kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_gives_the_reference_bits_or_a_named_error(model, dtype):
    rng = random.Random(1234 + (dtype == torch.bfloat16))
    m = model if dtype == torch.float32 else tiny_model("mlp_only", num_hidden_layers=2,
                                                        max_position_embeddings=48,
                                                        dtype=dtype).eval()
    V = m.config.vocab_size
    counts = {}
    with torch.no_grad():
        for case in range(FORWARD_CASES):
            g = torch.Generator().manual_seed(rng.randrange(2**31))
            seqs = [torch.randint(0, V, (rng.randint(1, 20),), generator=g)
                    for _ in range(rng.randint(1, 4))]
            ref = _reference(m, seqs)
            make = rng.choice([_packed_case, _padded_case, _cached_case])
            kw, want = make(rng, m, seqs, ref)
            pages = kw.get("unchanged")
            before = (list(pages.lengths), pages.free_pages) if pages is not None else None
            counts[make.__name__] = counts.get(make.__name__, 0) + 1
            if isinstance(want, str):
                _clean_error(lambda: _call(m, kw), want)
                if before is not None:  # a refused call changes nothing in the cache
                    assert (list(pages.lengths), pages.free_pages) == before, f"case {case}"
                continue
            got = _call(m, kw)
            assert torch.isfinite(got).all(), f"case {case}: non-finite logits"
            assert torch.equal(got, want), f"case {case} ({make.__name__}): not the reference"
    assert len(counts) == 3


# ---------------------------------------------------------------------------------------------
# from_pretrained
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny model saved twice: one file, and shards with an index."""
    model = tiny_model("mlp_only", num_hidden_layers=2)
    root = tmp_path_factory.mktemp("fuzz_ckpt")
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size=30_000)
    return model, root


def _corrupt(rng: random.Random, d):
    """Damage the checkpoint dir `d` one way: (what must be named | None, expected weights)."""
    files = sorted(d.glob("*.safetensors"))
    fn = rng.choice(files)
    tensors = load_file(str(fn))
    name = rng.choice(sorted(tensors))
    kind = rng.choice(["missing", "unexpected", "shape", "fp16", "bf16", "int", "fp64", "nan",
                       "truncate", "index", "config", "config_file"])
    if kind == "missing":
        del tensors[name]
    elif kind == "unexpected":
        name = "model.layers.0.mlp.shared_expert.weight"
        tensors[name] = torch.zeros(3)
        index = d / "model.safetensors.index.json"
        if index.exists():           # an index lists every tensor the loader reads
            data = json.loads(index.read_text())
            data["weight_map"][name] = fn.name
            index.write_text(json.dumps(data))
    elif kind == "shape":
        tensors[name] = tensors[name].reshape(-1)[:-1].contiguous()
    elif kind in ("fp16", "bf16"):   # exact widening into the fp32 model: loads, rounded values
        tensors[name] = tensors[name].to(torch.float16 if kind == "fp16" else torch.bfloat16)
        save_file(tensors, str(fn))
        return None, (name, tensors[name].float())
    elif kind in ("int", "fp64"):
        tensors[name] = tensors[name].to(rng.choice([torch.int64, torch.int32, torch.uint8])
                                         if kind == "int" else torch.float64)
    elif kind == "nan":
        tensors[name].view(-1)[rng.randrange(tensors[name].numel())] = rng.choice(
            [float("nan"), float("inf")])
    if kind in ("missing", "unexpected", "shape", "int", "fp64", "nan"):
        save_file(tensors, str(fn))
        return re.escape(name), None
    if kind == "truncate":
        data = fn.read_bytes()
        fn.write_bytes(data[:rng.randrange(len(data))])
        return re.escape(fn.name), None
    if kind == "index":
        index = d / "model.safetensors.index.json"
        if not index.exists():
            (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
            return "both model.safetensors and model.safetensors.index.json", None
        index.write_text(rng.choice(["{not json", "[1, 2]", '{"weight_map": 3}',
                                     '{"weight_map": {"x": "../y.safetensors"}}',
                                     '{"weight_map": {"x": "missing.safetensors"}}']))
        return "model.safetensors.index.json", None
    if kind == "config_file":
        (d / "config.json").unlink()
        return "config", None
    cfg = json.loads((d / "config.json").read_text())
    key = rng.choice(["num_experts", "hidden_size", "head_dim", "rms_norm_eps", "rope_theta",
                      "tie_word_embeddings", "vocab_size", "reduction_chunks", "mlp_only_layers"])
    cfg[key] = rng.choice(["8", None, -1, 0, 3.5, True, float("nan"), [1], 1e300])
    (d / "config.json").write_text(json.dumps(cfg))
    return "|".join([key, "does not match the model", "rope_theta"]), None


def test_from_pretrained_loads_exactly_or_names_the_damage(saved, tmp_path):
    model, root = saved
    rng = random.Random(99)
    for case in range(LOAD_CASES):
        layout = rng.choice(["single", "sharded"])
        d = tmp_path / f"case{case}"
        shutil.copytree(root / layout, d)
        named, weights = _corrupt(rng, d)
        if named is not None:
            _clean_error(lambda: Qwen3MoeForCausalLM.from_pretrained(d), named)
            continue
        loaded = Qwen3MoeForCausalLM.from_pretrained(d)
        hub, want = weights
        got = state_dict_hub(loaded)
        assert torch.equal(got[hub], want), f"case {case}: {hub}"
        for k, v in state_dict_hub(model).items():
            assert k == hub or torch.equal(got[k], v), f"case {case}: {k}"
        with tk.use("invariant"), torch.no_grad():
            assert torch.isfinite(loaded(torch.arange(10))).all()


def test_config_fuzz_refuses_or_builds(tmp_path):
    """Random values in every config field: Qwen3MoeConfig either refuses naming the field, or
    builds a model whose forward is finite."""
    rng = random.Random(7)
    base = Qwen3MoeConfig.preset("tiny", num_hidden_layers=2).to_hf()
    keys = sorted(k for k in base if k not in ("architectures", "model_type", "use_cache",
                                               "rope_parameters", "dtype"))
    values = [None, True, False, 0, 1, -1, 2, 8, 16, 3.5, float("nan"), float("inf"), "x",
              "float32", [], [0], {}, {"rope_type": "default"}, 1e6, 2**40]
    for _ in range(CONFIG_CASES):
        key, value = rng.choice(keys), rng.choice(values)
        d = dict(base, **{key: value})
        if key == "rope_theta":
            d.pop("rope_parameters", None)
        try:
            cfg = Qwen3MoeConfig.from_hf(d)
        except ValueError as e:
            assert key in str(e) or "rope" in str(e), f"{key}={value!r}: {e}"
            continue
        if cfg.num_hidden_layers <= 64:
            with torch.device("meta"):
                Qwen3MoeForCausalLM(cfg)                   # every size rule holds: it builds
