"""The consistency diagnoser names the layer and op where two paths first diverge, and why.

Each test injects one deliberate divergence on path B (a stock F.linear in one layer, a routing
tie broken the other way, a collective summed in another order, a cast to bfloat16, the fused
expert op on stock kernels) and checks the diagnosis; unmodified paths must report "no
divergence" (decode equals the full pass). The capture observes through forward hooks and the
layers' probe seam only: nothing is patched, and other threads' forwards are not recorded.
"""
from __future__ import annotations

import copy
import json
import os
import sys
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tonp_kernels as tk
from tonp_models import diagnose as dg
from tonp_models.layers import probe as seam
from tonp_models.diagnose.__main__ import main as cli_main
from tonp_models.diagnose.compare import align

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
            "q_rope", "k_rope", "self_attn.k", "self_attn.v", "self_attn.attention", "o_proj",
            "residual", "post_attention_layernorm", "mlp.router_logits", "mlp.route.ids",
            "mlp.route.weights", "mlp.expert.gate_up", "mlp.expert.act", "mlp.expert.down",
            "mlp.experts", "mlp.combine", "gate_proj", "up_proj", "mlp.act", "down_proj",
            "layer_out", "final_norm", "logits", "logprobs"} <= ops
    # one row per (token, chosen expert); the fused op's rows are the per-expert path's bits
    keys, down, _ = reference.gather(0, "mlp.expert.down")
    assert keys.shape[0] == sum(LENGTHS) * 2 and bool((keys[:, 2] >= 0).all())
    ra, rb, only_a, only_b = align(keys, reference.gather(0, "mlp.experts")[0])
    assert only_a == only_b == 0
    assert torch.equal(down[ra], reference.gather(0, "mlp.experts")[1][rb])


def test_probe_seam_is_one_cheap_hook_per_context():
    """probe() does nothing without a hook; the innermost hook of this thread gets every call
    with its meta; another thread sees none; wants_detail() is the hook's own choice."""
    seen = []
    assert not seam.probing() and not seam.wants_detail()
    seam.probe("x", torch.zeros(1))                       # no hook: nothing happens
    outer, inner = (lambda *a, **k: seen.append(("outer", a[0]))), \
        (lambda op, v, **meta: seen.append(("inner", op, meta)))
    seam.push_hook(outer)
    seam.push_hook(inner, detail=True)
    try:
        assert seam.probing() and seam.wants_detail()
        seam.probe("a", torch.zeros(1), kind="route")
        other = []
        t = threading.Thread(target=lambda: other.append((seam.probing(), seam.wants_detail())))
        t.start()
        t.join()
        assert other == [(False, False)]
        seam.pop_hook(inner)
        assert seam.probing() and not seam.wants_detail()
        seam.probe("b", torch.zeros(1))
    finally:
        seam.pop_hook(outer)
    assert seen == [("inner", "a", {"kind": "route"}), ("outer", "b")]
    assert not seam.probing()
    with pytest.raises(ValueError, match="not installed"):
        seam.pop_hook(outer)


def test_capture_patches_nothing_and_records_only_its_thread(model, seqs):
    """A Capture uses forward hooks and the probe seam only: no module global, tonp_parallel
    function or instance attribute is replaced, and forwards of other threads are not recorded."""
    import tonp_parallel
    from tonp_models.layers.moe import SparseMoeBlock
    reduce = tonp_parallel.reduce_from_region
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    before = [dict(vars(b)) for b in blocks]
    ids = torch.cat(seqs)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad(), dg.Capture(model, "x") as cap:
        for name, mod in list(sys.modules.items()):
            if name.startswith("tonp_models.") and hasattr(mod, "tk"):
                assert mod.tk is tk, name
        assert tonp_parallel.reduce_from_region is reduce
        assert [{k: v for k, v in vars(b).items() if not k.endswith("hooks")} for b in blocks] \
            == [{k: v for k, v in b0.items() if not k.endswith("hooks")} for b0 in before]
        cap.begin_forward([i for i, n in enumerate(LENGTHS) for _ in range(n)],
                          [j for n in LENGTHS for j in range(n)])
        t = threading.Thread(target=model, args=(ids, cu))
        t.start()
        t.join()
        assert cap.trace.records == []
        model(ids, cu)
    assert len(cap.trace.records) > 60
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_detail_off_observes_the_fused_op_only(model, seqs, reference):
    """Without detail the MoE block runs its fused op alone: its per (token, expert) rows are
    still compared ('mlp.experts'), the per-expert steps are not captured."""
    lean = dg.run_path(model, seqs, "decode", prompt_lens=[2], detail=False)
    ops = {op for _, op in lean.op_order()}
    assert "mlp.experts" in ops and not any(op.startswith("mlp.expert.") for op in ops)
    diag = dg.compare_traces(reference, lean)
    assert diag.first is None and diag.logdiff == 0.0, dg.format_text(diag)
    assert "layer 0 mlp.expert.gate_up" in diag.one_sided["a"]


def test_fused_expert_op_alone_diverges(model, seqs, reference, monkeypatch):
    """Path B's fused expert op on stock kernels while its per-expert reference path stays
    invariant: "operator arithmetic" at layer 0 mlp.experts, after equal per-expert steps."""
    fused = tk.moe_experts
    block = model.layers[0].mlp
    x = torch.randn(5, block.gate_up_proj.shape[2])
    ids = torch.tensor([[0, 3], [1, 2], [7, 0], [4, 5], [6, 1]])
    args = (x, ids, block.gate_up_proj.detach(), block.down_proj.detach())
    with tk.use("torch"):
        stock = fused(*args)
    assert not torch.equal(stock, fused(*args)), "precondition: stock experts must differ"

    def stock_fused(*a, **kw):
        with tk.use("torch"):
            return fused(*a, **kw)

    monkeypatch.setattr(tk, "moe_experts", stock_fused)
    diag = dg.compare_traces(reference, dg.run_path(model, seqs, "train", label="B"))
    f = diag.first
    assert (f.layer, f.op, f.classification) == (0, "mlp.experts", dg.OPERATOR), \
        dg.format_text(diag)
    equal = {o.op for o in diag.ops if o.layer == 0 and not o.rows_differing}
    assert {"mlp.expert.gate_up", "mlp.expert.act", "mlp.expert.down"} <= equal


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
    assert (f.layer, f.op, f.classification) == (2, "mlp.route.ids", dg.ROUTING), \
        dg.format_text(diag)
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
        seam.probe("partial", torch.stack(parts, 1), kind="partial")           # (T, 4, N)
        y = self.reduce(parts)
        seam.probe("reduce", y, kind="collective")
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
    assert (f.layer, f.op, f.classification) == (2, "mlp.router_logits", dg.WEIGHTS), \
        dg.format_text(diag)
    assert "layers.2.mlp.gate" in f.detail
    assert json.load(open(tmp_path / "diagnosis.json"))["first"]["op"] == "mlp.router_logits"


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
                             expert_rows=[t.gather(0, "mlp.expert.down")[0] for t in (a, b)])
    local = SparseMoeBlock._experts

    def stock_on_second_half(self, *args):  # experts 4..7 live on EP rank 1
        if self.first_expert == 0:
            return local(self, *args)
        with tk.use("torch"):
            return local(self, *args)

    SparseMoeBlock._experts = stock_on_second_half   # a fault injected for the test
    try:
        b = dg.run_layout(ckpt, seqs, dg.PathSpec.parse("train,ep=2"))
    finally:
        SparseMoeBlock._experts = local
    if a is not None:
        out["perturbed"] = dg.compare_traces(a, b).first
    return out if a is not None else None


def test_ep2_layout_equals_single_process(tmp_path):
    """Expert rows received from the other EP rank are named by the sender's dispatch record and
    merged on rank 0: EP 2 decode and TP 2 x EP 2 equal one process op by op (expert rows
    included); rank 1's experts on stock kernels -> "operator arithmetic" at layer 0
    mlp.expert.gate_up, on rows of experts 4..7 only."""
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
        (0, "mlp.expert.gate_up", dg.OPERATOR), f
    assert f.positions and all(e >= 4 for _, _, e in f.positions)


def test_moe_probes_with_no_rows(model):
    """A forward (or an EP rank's receipt) with no rows reports empty values, not an error."""
    block = model.layers[0].mlp
    seen = []

    def hook(op, value, **meta):
        seen.append((op, tuple(value.shape)))

    seam.push_hook(hook, detail=True)
    try:
        with torch.no_grad():
            y = block(torch.zeros(0, block.gate_up_proj.shape[2]))
    finally:
        seam.pop_hook(hook)
    assert y.shape == (0, 64) and ("experts", (0, 64)) in seen and ("combine", (0, 64)) in seen
