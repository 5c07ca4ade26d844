"""The consistency diagnoser names the layer and op where two paths first diverge, and why.

Each test injects one deliberate divergence on path B (a stock F.linear in one layer, a routing
tie broken the other way, a collective summed in another order, a cast to bfloat16) and checks
the diagnosis; unmodified paths must report "no divergence" (decode equals the full pass).
"""
from __future__ import annotations

import copy
import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tonp_kernels as tk
from tonp_models import diagnose as dg
from tonp_models.diagnose.__main__ import main as cli_main

sys.path.insert(0, os.path.dirname(__file__))
from model_helpers import random_seqs, tiny_model  # noqa: E402


# tiny "mlp_only": layer 0 MoE, layer 1 dense MLP, layer 2 MoE.
LENGTHS = (7, 4, 9)


@pytest.fixture(scope="module")
def model():
    return tiny_model("mlp_only", seed=3)


@pytest.fixture(scope="module")
def seqs(model):
    return random_seqs(LENGTHS, model.config.vocab_size, seed=1)


@pytest.fixture(scope="module")
def reference(model, seqs):
    return dg.run_path(model, seqs, "train", label="A")


def test_no_divergence_train_decode_padded(model, seqs, reference, tmp_path):
    """Decode (prefill + token-by-token through the paged cache) equals the full pass."""
    decode = dg.run_path(model, seqs, "decode", prompt_lens=[3])
    diag = dg.compare_traces(reference, decode)
    assert diag.first is None and diag.logdiff == 0.0, dg.format_text(diag)
    assert len(diag.ops) > 60 and not diag.one_sided["a"] and not diag.one_sided["b"]
    assert "no divergence" in dg.format_text(diag)
    _, js = dg.write_report(diag, str(tmp_path))
    assert json.load(open(js))["result"] == dg.NO_DIVERGENCE
    padded = dg.run_path(model, seqs, "padded")
    assert dg.compare_traces(reference, padded).first is None


def test_every_op_boundary_is_captured(reference):
    ops = {op for _, op in reference.op_order()}
    assert {"embed", "input_layernorm", "q_proj", "k_proj", "v_proj", "q_norm", "k_norm",
            "q_rope", "k_rope", "attn.k", "attn.v", "attention", "o_proj", "residual",
            "post_attention_layernorm", "router_logits", "route.ids", "route.weights",
            "expert.gate_up", "expert.act", "expert.down", "combine", "gate_proj", "up_proj",
            "mlp.act", "down_proj", "layer_out", "final_norm", "logits", "logprobs"} <= ops
    # one row per (token, chosen expert)
    keys, _, _ = reference.gather(0, "expert.down")
    assert keys.shape[0] == sum(LENGTHS) * 2 and bool((keys[:, 2] >= 0).all())


def test_stock_linear_in_one_layer(model, seqs, reference, monkeypatch):
    """Layer 1's k_proj computed by stock F.linear: "operator arithmetic" at layer 1 k_proj."""
    k_proj = model.layers[1].self_attn.k_proj
    x = torch.randn(sum(LENGTHS), k_proj.in_features)
    assert not torch.equal(F.linear(x, k_proj.weight), tk.linear(x, k_proj.weight)), \
        "precondition: stock F.linear must differ from tonp's linear on these shapes"
    monkeypatch.setattr(k_proj, "forward", lambda h: F.linear(h, k_proj.weight))
    diag = dg.compare_traces(reference, dg.run_path(model, seqs, "train", label="B"))
    f = diag.first
    assert (f.layer, f.op, f.classification) == (1, "k_proj", dg.OPERATOR), dg.format_text(diag)
    assert f.max_abs_diff > 0 and f.positions and diag.logdiff > 0
    text = dg.format_text(diag)
    assert "layer 1 k_proj" in text and "operator arithmetic" in text
    later = [o for o in diag.ops if o.rows_differing and o is not f]
    assert later and all(o.classification == dg.PROPAGATED for o in later)


def _tied_router(model, layer, a=2, b=5):
    """Only experts a and b have router weights, and the same ones: they tie for every token
    (and the zero-logit experts tie with each other)."""
    gate = model.layers[layer].mlp.gate
    saved = gate.detach().clone()
    with torch.no_grad():
        row = gate[a].clone()
        gate.zero_()
        gate[a], gate[b] = row, row
    return saved


def test_routing_tie_broken_the_other_way(seqs, monkeypatch):
    model = tiny_model("mlp_only", seed=3)
    _tied_router(model, layer=2)
    a = dg.run_path(model, seqs, "train", label="A")
    route = tk.moe_route

    def ties_to_higher_id(logits, top_k, normalize):
        ids, w = route(logits, top_k, normalize)
        tie = w[:, 0] == w[:, 1]                  # equal probabilities: the order is a choice
        ids = ids.clone()
        ids[tie] = ids[tie].flip(-1)
        return ids, w

    monkeypatch.setattr(tk, "moe_route", ties_to_higher_id)
    diag = dg.compare_traces(a, dg.run_path(model, seqs, "train", label="B"))
    f = diag.first
    assert (f.layer, f.op, f.classification) == (2, "route.ids", dg.ROUTING), dg.format_text(diag)
    assert f.rows_differing == sum(LENGTHS)
    assert "routing decision flipped" in dg.format_text(diag)


class FourRankRowParallel(nn.Module):
    """Stands in for a row-parallel o_proj at TP 4 in one process: four ranks' fp32 partials
    (each C/4 chunks of the tree), then a reduce over "ranks" done by `reduce`."""

    def __init__(self, weight: torch.Tensor, chunks: int, reduce):
        super().__init__()
        self.weight, self.chunks, self.reduce = weight, chunks, reduce

    def forward(self, x):
        k = x.shape[-1] // 4
        parts = [tk.linear_partial(x[:, r * k:(r + 1) * k].contiguous(),
                                   self.weight[:, r * k:(r + 1) * k].contiguous(),
                                   chunks=self.chunks // 4) for r in range(4)]
        dg.probe("partial", torch.stack(parts, 1), kind="partial")             # (T, 4, N)
        y = self.reduce(parts)
        dg.probe("reduce", y, kind="collective")
        return y.to(x.dtype)


def test_collective_summed_in_another_order(model, seqs):
    """Path A reduces four ranks' partials by the contract's tree, path B left to right."""
    attn = model.layers[1].self_attn
    o_proj = attn.o_proj
    tree = FourRankRowParallel(o_proj.weight.detach(), o_proj.chunks, tk.tree_sum)
    ring = FourRankRowParallel(o_proj.weight.detach(), o_proj.chunks,
                               lambda p: ((p[0] + p[1]) + p[2]) + p[3])
    try:
        attn.o_proj = tree
        a = dg.run_path(model, seqs, "train", label="tree")
        attn.o_proj = ring
        b = dg.run_path(model, seqs, "train", label="ring")
    finally:
        attn.o_proj = o_proj
    diag = dg.compare_traces(a, b)
    f = diag.first
    assert (f.layer, f.op, f.classification) == (1, "o_proj.reduce", dg.COLLECTIVE), \
        dg.format_text(diag)
    assert any(o.op == "o_proj.partial" and o.rows_differing == 0 for o in diag.ops)


def test_precision_cast(model, seqs, reference, monkeypatch):
    """Layer 0's input norm rounded to bfloat16 on path B: a "precision cast"."""
    norm = model.layers[0].input_layernorm
    monkeypatch.setattr(norm, "forward",
                        lambda x: tk.rms_norm(x, norm.weight, norm.eps).bfloat16().float())
    diag = dg.compare_traces(reference, dg.run_path(model, seqs, "train", label="B"))
    f = diag.first
    assert (f.layer, f.op, f.classification) == (0, "input_layernorm", dg.PRECISION), \
        dg.format_text(diag)


def test_two_checkpoints(model, seqs, tmp_path):
    """One weight changed in layer 2's router: "weights differ" there, via the public API."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.layers[2].mlp.gate[1, 0] += 0.01
    diag = dg.diagnose(model, seqs, "train", "train", model_b=other, out_dir=str(tmp_path))
    f = diag.first
    assert (f.layer, f.op, f.classification) == (2, "router_logits", dg.WEIGHTS), \
        dg.format_text(diag)
    assert "layers.2.mlp.gate" in f.detail
    assert json.load(open(tmp_path / "diagnosis.json"))["first"]["op"] == "router_logits"


def _external_file(model, seqs, path, perturb):
    """tonp's own logprobs in three exported shapes, one token perturbed by +0.5."""
    lps = [lp.tolist() for lp in model.token_logprobs(seqs)]
    s, j = perturb
    lps[s][j - 1] += 0.5                                            # token j of sequence s
    ids = [x.tolist() for x in seqs]
    recs = [  # canonical (n - 1 entries); vLLM (prompt_logprobs + top-logprob dicts); SGLang
        {"token_ids": ids[0], "logprobs": lps[0]},
        {"prompt_token_ids": ids[1][:2], "prompt_logprobs": [None, {str(ids[1][1]): lps[1][0]}],
         "outputs": [{"token_ids": ids[1][2:],
                      "logprobs": [{str(t): {"logprob": v, "rank": 1}}
                                   for t, v in zip(ids[1][2:], lps[1][1:])]}]},
        {"input_ids": ids[2][:3], "output_ids": ids[2][3:],
         "meta_info": {"output_token_logprobs": [[v, t, "x"] for t, v in
                                                 zip(ids[2][3:], lps[2][2:])]}},
    ]
    with open(path, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in recs)
    return path


def test_external_comparison_flags_the_perturbed_token(model, seqs, tmp_path):
    path = _external_file(model, seqs, tmp_path / "ext.jsonl", perturb=(2, 6))
    ext = dg.load_jsonl(str(path))
    assert [e.source for e in ext] == ["tonp", "vllm", "sglang"]
    assert [int(e.logprobs.isnan().logical_not().sum()) for e in ext] == [6, 3, 6]
    rep = dg.compare_external(model, ext)
    assert rep.tokens_compared == 15 and rep.tokens_over_threshold == 1
    assert rep.tokens_not_bitwise_equal == 1 and abs(rep.max_abs_diff - 0.5) < 1e-6
    assert rep.first_divergent[0] is None and rep.first_divergent[1] is None
    assert rep.first_divergent[2]["index"] == 6
    paths = dg.write_external_report(rep, str(tmp_path / "out"))
    assert os.path.getsize(paths["png"]) > 1000
    assert "seq 2: token index 6" in open(paths["text"]).read()


def test_cli(tmp_path, model, seqs):
    out = str(tmp_path / "cli")
    assert cli_main(["--preset", "tiny", "--paths", "train:decode", "--num-seqs", "2",
                     "--seq-len", "6", "--out", out]) == 0
    assert json.load(open(os.path.join(out, "diagnosis.json")))["result"] == dg.NO_DIVERGENCE
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    ext = _external_file(model, seqs, tmp_path / "ext.jsonl", perturb=(0, 3))
    assert cli_main(["--hf", str(ckpt), "--external", str(ext), "--out", out]) == 0
    body = json.load(open(os.path.join(out, "external.json")))
    assert body["first_divergent"][0]["index"] == 3 and body["tokens_over_threshold"] == 1


def test_bad_input():
    with pytest.raises(ValueError, match="unknown part"):
        dg.PathSpec.parse("train,fast")
    with pytest.raises(ValueError, match="logprobs"):
        dg.parse_record({"token_ids": [1, 2, 3], "logprobs": [0.0] * 5})


def _layouts_rank(ckpt):
    from tonp_models.diagnose.layout import run_layout
    seqs = random_seqs((5, 3), 320, seed=2)
    a = run_layout(ckpt, seqs, dg.PathSpec.parse("train"))
    b = run_layout(ckpt, seqs, dg.PathSpec.parse("decode,tp=2"))
    if a is None:
        return None
    diag = dg.compare_traces(a, b)
    return dict(first=diag.first, ops=len(diag.ops), only_b=diag.one_sided["b"],
                logdiff=diag.logdiff, mismatch=b.meta.get("rank_mismatch"))


def test_tp2_layout_equals_tp1(model, tmp_path):
    """Captured per rank, merged on rank 0 (column shards concatenated): TP 2 decode vs TP 1."""
    from dist_utils import run_distributed
    model.save_pretrained(tmp_path / "ckpt")
    out = run_distributed(_layouts_rank, 2, str(tmp_path / "ckpt"), timeout=240)[0]
    assert out["first"] is None and out["logdiff"] == 0.0 and out["mismatch"] is None, out
    assert out["ops"] > 60 and "layer 1 o_proj.reduce" in out["only_b"]


def _ep_layouts_rank(ckpt):
    """EP 2 (and TP 2 x EP 2) vs one process; then EP 2 with rank 1's experts on stock kernels."""
    from tonp_models.layers.moe import SparseMoeBlock
    seqs = random_seqs((6, 3, 5), 320, seed=2)
    a = dg.run_layout(ckpt, seqs, dg.PathSpec.parse("train"))
    out = {}
    for name in ("decode,ep=2", "train,tp=2,ep=2"):
        b = dg.run_layout(ckpt, seqs, dg.PathSpec.parse(name))
        if a is not None:
            diag = dg.compare_traces(a, b)
            out[name] = dict(first=diag.first, logdiff=diag.logdiff, ops=len(diag.ops),
                             mismatch=b.meta.get("rank_mismatch"),
                             expert_rows=[t.gather(0, "expert.down")[0] for t in (a, b)])
    local = SparseMoeBlock._run_local_experts

    def stock_on_second_half(self, *args):  # experts 4..7 live on EP rank 1
        if self.first_expert == 0:
            return local(self, *args)
        with tk.use("torch"):
            return local(self, *args)

    SparseMoeBlock._run_local_experts = stock_on_second_half
    try:
        b = dg.run_layout(ckpt, seqs, dg.PathSpec.parse("train,ep=2"))
    finally:
        SparseMoeBlock._run_local_experts = local
    if a is not None:
        out["perturbed"] = dg.compare_traces(a, b).first
    return out if a is not None else None


def test_ep2_layout_equals_single_process(tmp_path):
    """Expert rows received from the other EP rank are named by the sender's dispatch record and
    merged on rank 0: EP 2 decode and TP 2 x EP 2 equal one process op by op (expert rows
    included); rank 1's experts on stock kernels -> "operator arithmetic" at layer 0
    expert.gate_up, on rows of experts 4..7 only."""
    from dist_utils import run_distributed
    model = tiny_model("mlp_only", seed=3, num_hidden_layers=2, mlp_only_layers=[])
    model.save_pretrained(tmp_path / "ckpt")
    out = run_distributed(_ep_layouts_rank, 2, str(tmp_path / "ckpt"), timeout=240)[0]
    for name in ("decode,ep=2", "train,tp=2,ep=2"):
        r = out[name]
        assert r["first"] is None and r["logdiff"] == 0.0 and r["mismatch"] is None, (name, r)
        assert r["ops"] > 40
        ka, kb = r["expert_rows"]  # every (token, expert) row once, the same set on both paths
        assert ka.shape[0] == 14 * 2 and sorted(ka.tolist()) == sorted(kb.tolist()), name
    f = out["perturbed"]
    assert f is not None and (f.layer, f.op, f.classification) == \
        (0, "expert.gate_up", dg.OPERATOR), f
    assert f.positions and all(e >= 4 for _, _, e in f.positions)
