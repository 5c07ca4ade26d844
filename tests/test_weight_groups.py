"""Weight column groups (kernels.h; tonp_kernels.pack_weight_groups): a copy of the expert weights
laid out the way the AVX512-BF16 build's tiles read them: bf16 in eight-column groups for the
one-row tiles, fp32 in sixteen-column panels in the lane tiles' order for every row count. The copy
changes where the bytes are read from, never a bit; where it is read is owned by the engine, so a
stale copy can never reach a training or scoring forward.

The AVX2 build reads fp32 groups only, from four rows a task; the portable build none. Where a
build reads no groups of a dtype pack_weight_groups returns None and the kernels are the in-place
ones: the tests below that need a copy assert that this is why."""
from __future__ import annotations

import pytest
import torch

import tonp_kernels as tk
from conftest import assert_bitwise
from test_generation import prompts, rollout_logdiff, tiny_model
from tonp_models import generate
from tonp_models.engine import Engine, Request, SamplingParams
from tonp_models.layers.moe import SparseMoeBlock
from tonp_models.layers.weight_groups import reading_weight_groups



def reads_groups(dtype, isa=None) -> bool:
    """Whether the build (this process's by default) reads groups of weights of this dtype."""
    isa = isa or tk.isa()
    return isa == "avx512bf16" or (isa == "avx2" and dtype == torch.float32)


def group_rows(dtype) -> int:
    """The rows a task needs to read this dtype's groups in this build (AVX2 fp32:
    linear_impl.h's kGroupRowsBuild)."""
    return 4 if tk.isa() == "avx2" and dtype == torch.float32 else 1


def bf16_group_rows_max() -> int:
    """The most rows whose bf16 x bf16 tasks read bf16 groups: one, and on Intel's AVX512-BF16
    table six (bf16dot_hw.h: pair tiles of up to kGroupPairsIntel pairs on the group)."""
    return 6 if tk.isa() == "avx512bf16" and _intel() else 1


DTYPES = [torch.bfloat16, torch.float32]


def _experts(E, I, H, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, 2 * I, H, generator=g).to(dtype),
            torch.randn(E, H, I, generator=g).to(dtype))


def _packed(w, chunks):
    p = tk.pack_weight_groups(w, chunks)
    if not reads_groups(w.dtype):
        assert p is None, f"the {tk.isa()} build's tiles read no {w.dtype} groups: no copy to make"
        pytest.skip(f"the {tk.isa()} build reads no {w.dtype} weight groups")
    return p


def test_bf16_pack_layout_is_the_columns_blocks_side_by_side():
    """Group g, chunk c, block b holds columns 8g..8g+7's elements c*kc + 16b .. + 16, zero past
    kc (one pair-chain step of the one-row tile)."""
    w = torch.arange(16 * 40, dtype=torch.float32).reshape(16, 40).bfloat16()  # N = 16, K = 40
    p = _packed(w, 2)                                      # kc = 20 -> 2 blocks
    assert p.shape == (2, 2, 2 * 8 * 16) and p.dtype == torch.bfloat16   # [group][chunk][...]
    v = p.view(2, 2, 2, 8, 16)                             # [group][chunk][block][col][16]
    for g in range(2):
        for c in range(2):
            for b in range(2):
                for j in range(8):
                    n, k0 = 8 * g + j, 20 * c + 16 * b
                    want = torch.zeros(16, dtype=torch.bfloat16)
                    m = min(16, 20 - 16 * b)
                    want[:m] = w[n, k0:k0 + m]
                    assert torch.equal(v[g, c, b, j], want), (g, c, b, j)


def test_fp32_pack_layout_is_the_tables_lane_order():
    """Panel g (columns 16g..16g+15), chunk c: the chunk's k's in the order the table's lane
    passes read them, each as the sixteen columns' elements. The AVX-512 table's two-lane passes:
    lanes 0 and 1 step by step (k = 0, 1, 8, 9, 16, 17), then lanes 2-3, 4-5, 6-7, a lane with
    one step more than its pair's ending the run, shaped [panel, chunk, 16 * kc]. The AVX2
    table's one-lane passes: lane 0's k's (0, 8, 16), then lane 1's, ..., shaped [panel, chunk,
    kc, 16] (kc = 20: lanes 0-3 have three steps, 4-7 two). Columns past the last whole panel are
    left out."""
    w = torch.arange(40 * 40, dtype=torch.float32).reshape(40, 40)   # N = 40: 2 panels + 8 columns
    p = _packed(w, 2)                                                 # kc = 20
    if tk.isa() == "avx512bf16":
        assert p.shape == (2, 2, 20 * 16)
        order = [0, 1, 8, 9, 16, 17, 2, 3, 10, 11, 18, 19, 4, 5, 12, 13, 6, 7, 14, 15]
    else:
        assert p.shape == (2, 2, 20, 16)
        order = [0, 8, 16, 1, 9, 17, 2, 10, 18, 3, 11, 19, 4, 12, 5, 13, 6, 14, 7, 15]
    assert p.dtype == torch.float32
    v = p.view(2, 2, 20, 16)                               # [panel][chunk][position][col]
    for g in range(2):
        for c in range(2):
            for j, k in enumerate(order):
                assert torch.equal(v[g, c, j], w[16 * g:16 * g + 16, 20 * c + k]), (g, c, j, k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E,I,H,chunks", [(8, 96, 128, 8), (4, 40, 72, 2), (6, 64, 2048, 8),
                                           (3, 48, 200, 4), (5, 36, 64, 1), (3, 44, 84, 2),
                                           (4, 32, 48, 8)])
def test_moe_experts_with_groups_is_bitwise_in_place(E, I, H, chunks, dtype):
    """Every row count (bf16: one row an expert reads the groups, on Intel up to six in pair
    tiles, more rows read in place; fp32: every row count (AVX2: from two) reads them, in lane
    tiles of 1-8 rows, full tiles prefetching ahead), chunks
    whose size is not a multiple of the block or of a lane step (bf16's zero-padded blocks and
    tail step, fp32's lanes with one step more than their pair's), chunks of at most one lane
    step (kc <= 8), N not a multiple of 8 (the last columns in place) or of 16 (an edge panel):
    the same bits as without the copy."""
    gu, dn = _experts(E, I, H, dtype=dtype)
    gug, dng = _packed(gu, chunks), _packed(dn, chunks)
    g = torch.Generator().manual_seed(1)
    for M in (1, 2, 3, 5, 9, 17, 40, 130):
        x = torch.randn(M, H, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(M)])
        want = tk.moe_experts(x, ids, gu, dn, chunks=chunks)
        got = tk.moe_experts(x, ids, gu, dn, chunks=chunks, gate_up_groups=gug, down_groups=dng)
        assert_bitwise(got, want, f"M={M}")


@pytest.mark.parametrize("pair_tiles", ["0", "1"])
def test_moe_experts_fp32_give_the_portable_bits_in_either_lane_layout(pair_tiles, monkeypatch):
    """fp32 experts on their groups and in place, a panel at a time or two in 6-row tiles (Intel's
    choice, TONP_FORCE_PAIR_TILES=1 on any AVX512-BF16 CPU): gate_up of 12 panels at chunks of 20,
    down of 10 at chunks of 12, rows an expert across the tiles: the portable build's bits."""
    gu, dn = _experts(4, 96, 160, dtype=torch.float32)
    gug, dng = tk.pack_weight_groups(gu, 8), tk.pack_weight_groups(dn, 8)
    g = torch.Generator().manual_seed(3)
    for M in (3, 40, 130):
        x = torch.randn(M, 160, generator=g)
        ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(M)])
        monkeypatch.setenv("TONP_FORCE_PORTABLE", "1")
        want = tk.moe_experts(x, ids, gu, dn)
        monkeypatch.delenv("TONP_FORCE_PORTABLE")
        monkeypatch.setenv("TONP_FORCE_PAIR_TILES", pair_tiles)
        assert_bitwise(tk.moe_experts(x, ids, gu, dn), want, f"M={M} in place")
        assert_bitwise(tk.moe_experts(x, ids, gu, dn, gate_up_groups=gug, down_groups=dng), want, f"M={M} groups")


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_reads_the_groups_it_is_given(dtype):
    """The twin: groups packed from other weights of the same shape change a one-row output (so
    the equality above compares a path that really reads them); two, four and eight rows an
    expert read them in fp32 (every row count), in bf16 up to bf16_group_rows_max() rows (one,
    on Intel six). The AVX2 build reads fp32 groups from four rows: there one and two rows read
    W in place."""
    gu, dn = _experts(8, 96, 128, dtype=dtype)
    other_gu, other_dn = _experts(8, 96, 128, seed=5, dtype=dtype)
    gug, dng = _packed(other_gu, 8), _packed(other_dn, 8)
    x8 = torch.randn(8, 128).to(dtype)
    for ids, rows in ((torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]]), 1),   # every expert one row
                      (torch.tensor([[0, 1], [0, 1], [2, 3], [2, 3]]), 2),   # two rows an expert
                      (torch.tensor([[0, 1]] * 4), 4),                       # four rows an expert
                      (torch.tensor([[0, 1]] * 8), 8)):                      # eight rows an expert
        x = x8[:ids.shape[0]]
        got, in_place = (tk.moe_experts(x, ids, gu, dn, gate_up_groups=gug, down_groups=dng),
                         tk.moe_experts(x, ids, gu, dn))
        reads = rows >= group_rows(dtype) and (dtype == torch.float32 or rows <= bf16_group_rows_max())
        if reads:
            assert not torch.equal(got, in_place), f"{rows} row(s): the groups not read"
        else:
            assert_bitwise(got, in_place, f"{rows} row(s): W in place")


def test_bad_groups_are_refused_with_the_reason():
    gu, dn = _experts(3, 48, 200)
    x, ids = torch.randn(1, 200).bfloat16(), torch.tensor([[0, 1]])
    gug = tk.pack_weight_groups(gu, 4)
    dng = tk.pack_weight_groups(dn, 4)
    if gug is not None:   # packed for other chunks, or swapped
        with pytest.raises(ValueError, match="pack_weight_groups of gate_up .* chunks=8"):
            tk.moe_experts(x, ids, gu, dn, chunks=8, gate_up_groups=gug)
        with pytest.raises(ValueError, match="down_groups has shape"):
            tk.moe_experts(x, ids, gu, dn, chunks=4, gate_up_groups=gug, down_groups=gug)
    with pytest.raises(TypeError, match="contiguous CPU tensor of the weight's dtype Float .*got BFloat16"):
        tk.moe_experts(x.float(), ids, gu.float(), dn.float(), chunks=4,
                       gate_up_groups=torch.zeros(8, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="contiguous CPU tensor of the weight's dtype BFloat16 .*got Float"):
        tk.moe_experts(x, ids, gu, dn, chunks=4, gate_up_groups=torch.zeros(8))
    if gug is not None:
        with pytest.raises(TypeError, match="not contiguous"):
            tk.moe_experts(x, ids, gu, dn, chunks=4, gate_up_groups=gug.transpose(0, 1))
    assert tk.pack_weight_groups(torch.zeros(4, 64).bfloat16(), 2) is None   # N < 8
    with pytest.raises(ValueError, match="chunks must be a power of two"):
        tk.pack_weight_groups(gu, 3)
    with pytest.raises(ValueError, match="not divisible by chunks=16"):
        tk.pack_weight_groups(gu, 16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("env", [("TONP_FORCE_AVX2", "1"), ("TONP_FORCE_PORTABLE", "1")])
def test_other_builds_make_their_groups_and_ignore_others(env, dtype, monkeypatch):
    """The kernel table is chosen at every call. The portable table (and the AVX2 one for bf16)
    reads W in place: pack_weight_groups makes no groups there, and groups made by the
    AVX512-BF16 table are ignored: the same bits as that table's in place, and as with no groups
    at all. The AVX2 table reads fp32 groups from four rows an expert, its lanes one after
    another: it makes its own copy (on an AVX512-BF16 CPU, in another order and shape than that
    table's lane pairs, whose copy it then ignores), the same bits again."""
    native = tk.isa()
    gu, dn = _experts(6, 64, 256, dtype=dtype)
    gug, dng = _packed(gu, 8), _packed(dn, 8)
    x = torch.randn(4, 256).to(dtype)
    want = {}
    for name, ids in (("two rows an expert", torch.tensor([[0, 1], [0, 1], [2, 3], [2, 3]])),
                      ("four rows an expert", torch.tensor([[0, 1], [0, 1], [0, 1], [0, 1]]))):
        want[name] = (ids, tk.moe_experts(x, ids, gu, dn))
    monkeypatch.setenv(*env)
    isa = tk.isa()
    assert isa == ("avx2" if env[0] == "TONP_FORCE_AVX2" else "portable")
    made = tk.pack_weight_groups(gu, 8)
    if not reads_groups(dtype, isa):
        assert made is None
    elif isa == native or dtype == torch.bfloat16:
        assert_bitwise(made, gug, f"{isa}'s groups are the {native} table's")
    else:   # AVX2 on an AVX512-BF16 CPU: lane runs [.., kc, 16], not lane pairs [.., 16 * kc]
        assert made.shape == gug.shape[:-1] + (gug.shape[-1] // 16, 16), (made.shape, gug.shape)
        assert not torch.equal(made.flatten(), gug.flatten())
        assert torch.equal(made.flatten().sort().values, gug.flatten().sort().values)
    for name, (ids, w) in want.items():
        assert_bitwise(tk.moe_experts(x, ids, gu, dn, gate_up_groups=gug, down_groups=dng), w,
                       f"{env[0]} with groups, {name}")
    if reads_groups(dtype, isa):   # the twin: groups of other weights change what reads them
        other = _experts(6, 64, 256, seed=5, dtype=dtype)
        og, od = tk.pack_weight_groups(other[0], 8), tk.pack_weight_groups(other[1], 8)
        for name, (ids, w) in want.items():
            got = tk.moe_experts(x, ids, gu, dn, gate_up_groups=og, down_groups=od)
            if name == "two rows an expert":    # below the AVX2 table's group_rows_f32: W in place
                assert_bitwise(got, w, f"{isa}, two rows an expert read W")
            else:
                assert not torch.equal(got, w), f"{isa}, {name}: the groups not read"



def test_fp32_groups_in_the_other_lane_order_are_read_in_place():
    """A copy in the other table's lane order (its shape: lane pairs [.., 16 * kc], lane runs
    [.., kc, 16]) is never read as this table's: moe_experts and linear then read W in place,
    the same bits as without groups. The twin: the same copy in this table's shape changes them.
    (Every table switch in a process, TONP_FORCE_AVX2 on an AVX512-BF16 CPU, meets this.)"""
    gu, dn = _experts(6, 64, 256, dtype=torch.float32)
    ogu, odn = _experts(6, 64, 256, seed=5, dtype=torch.float32)
    og, od = _packed(ogu, 8), _packed(odn, 8)
    def other_order(g):   # the same floats in the other table's shape
        pairs = tk.isa() == "avx512bf16"
        return g.view(*g.shape[:-1], g.shape[-1] // 16, 16) if pairs else g.view(*g.shape[:-2], -1)
    x, ids = torch.randn(8, 256), torch.tensor([[0, 1]] * 8)        # eight rows an expert
    want = tk.moe_experts(x, ids, gu, dn)
    assert not torch.equal(tk.moe_experts(x, ids, gu, dn, gate_up_groups=og, down_groups=od), want)
    assert_bitwise(tk.moe_experts(x, ids, gu, dn, gate_up_groups=other_order(og), down_groups=other_order(od)),
                   want, "moe_experts, the other lane order")
    w, ow = gu[0], ogu[0]                                          # [128, 256]
    g = _packed(ow, 8)
    xl = torch.randn(40, 256)
    assert not torch.equal(tk.linear(xl, w, weight_groups=g), tk.linear(xl, w))
    assert_bitwise(tk.linear(xl, w, weight_groups=other_order(g)), tk.linear(xl, w), "linear, the other lane order")

def _block(dtype=torch.bfloat16):
    torch.manual_seed(0)
    b = SparseMoeBlock(256, 96, 16, 4, True, dtype=dtype)
    with torch.no_grad():
        for p in b.parameters():
            p.normal_(std=0.05)
    return b


@pytest.mark.parametrize("dtype", DTYPES)
@torch.no_grad()
def test_only_a_forward_inside_reading_weight_groups_reads_them(dtype):
    """A training or scoring forward never reads the copy (corrupted here to show which path
    ran); inside the engine's context it does, and a copy whose weights changed is dropped."""
    b, x = _block(dtype), torch.randn(1, 256).to(dtype)
    want = b(x)
    b.pack_weight_groups()
    def padded_bytes(w):   # bf16: whole groups of 8 columns, each chunk padded to 16 elements;
        E, N, K = w.shape  # fp32: whole panels of 16 columns, chunks unpadded
        cols, blk = (16, 1) if dtype == torch.float32 else (8, 16)
        return E * (N // cols * cols) * b.chunks * (-(-K // b.chunks // blk) * blk) * w.element_size()
    assert b.weight_group_bytes() == (0 if not reads_groups(dtype) else
                                      padded_bytes(b.gate_up_proj) + padded_bytes(b.down_proj))
    with reading_weight_groups():
        assert_bitwise(b(x), want, "inside, a current copy")
    if not reads_groups(dtype) or group_rows(dtype) > 1:   # a one-row x: read only from one row
        return
    b._groups[1][0].neg_()                                 # a wrong copy, same key
    assert_bitwise(b(x), want, "outside, whatever the copy holds")
    with reading_weight_groups():
        assert not torch.equal(b(x), want)                 # inside: the copy is what is read
    b.gate_up_proj.add_(0.0)                               # an in-place write: the version moves
    assert not b.weight_groups_current()
    with reading_weight_groups():
        assert_bitwise(b(x), want, "inside, a copy of other weights is not read")
    assert b._groups is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_rollout_with_groups_is_bitwise_the_training_forward(dtype):
    """generate() with the copy (the default) and without: the same tokens and logprobs, and
    logdiff 0 against the training forward; the model keeps the copy for the next call until
    drop_weight_groups()."""
    m = tiny_model(dtype)
    ps = prompts()
    with_groups = generate(m, ps, 10, max_batch_size=4)
    blocks = [b for b in m.modules() if isinstance(b, SparseMoeBlock)]
    assert all(b.weight_groups_current() for b in blocks)
    assert all((b.weight_group_bytes() > 0) == reads_groups(dtype) for b in blocks)
    held = [b._groups[1][0] for b in blocks]
    if reads_groups(dtype):      # an engine without weight groups reads none the model holds
        for t in held:
            t.neg_()
    without = generate(m, ps, 10, max_batch_size=4, weight_groups=False)
    if reads_groups(dtype):
        for t in held:
            t.neg_()
    for a, b in zip(with_groups.sequences, without.sequences, strict=True):
        assert_bitwise(a, b, "tokens")
    for a, b in zip(with_groups.logprobs, without.logprobs, strict=True):
        assert_bitwise(a, b, "logprobs")
    assert rollout_logdiff(m, with_groups, 0.0) == (0.0, True)
    m.drop_weight_groups()
    assert all(b._groups is None for b in blocks)
    with pytest.raises(TypeError, match="weight_groups must be True or False"):
        generate(m, ps, 1, weight_groups=1)
    with pytest.raises(TypeError, match="weight_groups must be True or False"):
        Engine(m, weight_groups="no")


def test_engine_packs_what_is_missing_or_stale_and_everything_after_an_update():
    """An engine packs on its first step; a torch optimizer step makes every copy stale (torch's
    fused AdamW bumps no version counter: the global step hook is what sees it), a tracked
    in-place write the written layer's; clear_prefix_cache (every weight update through the
    service calls it) re-packs them all. Each rollout equals the training forward of the weights
    as they are then."""
    torch.manual_seed(0)
    from tonp_models import Qwen3MoeConfig, Qwen3MoeForCausalLM
    m = Qwen3MoeForCausalLM(Qwen3MoeConfig.preset("tiny", num_hidden_layers=3,
                                                  mlp_only_layers=[1]), dtype=torch.bfloat16)
    with torch.no_grad():
        m.lm_head.weight.mul_(10.0)
    blocks = [b for b in m.modules() if isinstance(b, SparseMoeBlock)]
    assert len(blocks) == 2
    engine = Engine(m, max_batch_size=4)
    assert engine.weight_group_bytes == 0
    ps = prompts()[:3]
    engine.add(Request("a", ps[0].tolist(), SamplingParams(max_new_tokens=2)))
    engine.step()
    assert (engine.weight_group_bytes > 0) == reads_groups(torch.bfloat16)
    assert engine.refresh_weight_groups() == 0
    out = generate(m, ps, 6)
    assert rollout_logdiff(m, out, 0.0) == (0.0, True)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
    versions = [b.gate_up_proj._version for b in blocks]
    m.train()
    sum(lp.sum() for lp in m.token_logprobs([torch.cat([p, p]) for p in ps])).backward()
    opt.step()
    m.eval()
    assert [b.gate_up_proj._version for b in blocks] == versions   # no counter moved ...
    assert not any(b.weight_groups_current() for b in blocks)      # ... the step hook saw it
    out = generate(m, ps, 6)
    assert rollout_logdiff(m, out, 0.0) == (0.0, True)
    assert engine.refresh_weight_groups() == 0                      # generate re-packed them
    with torch.no_grad():
        blocks[1].down_proj.mul_(1.5)                               # a tracked write: one layer
    assert engine.refresh_weight_groups() == 1
    engine.clear_prefix_cache()
    holders = [x for x in m.modules() if hasattr(x, "pack_weight_groups")]   # experts, dense
    assert len(holders) > len(blocks)
    assert engine.refresh_weight_groups() == len(holders)        # every holder re-packed
    out = generate(m, ps, 6)
    assert rollout_logdiff(m, out, 0.0) == (0.0, True)
    engine.drop_weight_groups()
    assert engine.weight_group_bytes == 0


# --- the dense linear (tk.linear's weight_groups; the layers' dense_grouped) ------------------
def lane_rows() -> int:
    """The rows from which the fp32 linear's tasks read fp32 groups (through lane passes), as
    this process's table says; 0 where it reads none."""
    return torch.ops.tonp.linear_group_rows()


def _cpuinfo() -> str:
    try:
        return open("/proc/cpuinfo").read()
    except OSError:
        return ""


def _amd_family() -> int:
    """This CPU's family if it is an AMD one (/proc/cpuinfo), else 0."""
    info = _cpuinfo()
    if "AuthenticAMD" not in info:
        return 0
    return int(next(ln for ln in info.splitlines() if ln.startswith("cpu family")).split(":")[1])


def _intel() -> bool:
    return "GenuineIntel" in _cpuinfo()


@pytest.mark.parametrize("env", [None, ("TONP_FORCE_AVX2", "1"), ("TONP_FORCE_PORTABLE", "1")])
def test_linear_group_rows_follow_the_table_and_the_cpu(env, monkeypatch):
    """The row count from which tk.linear reads fp32 groups is a speed choice per table and, on
    the AVX-512 one, per CPU (kernels.h: every row count on an AMD Zen 5, family 26, where the
    lane tiles ran 1.2-1.7x the dot tiles at 1-28 rows; every row count on Intel too, 1.15-1.5x
    at 2-19 rows and, with a lone tile's 1 KB fetch, 1.16-1.20x at one row at K = 2048; 20
    elsewhere); the AVX2 table 8; the portable table reads none."""
    if env is not None:
        monkeypatch.setenv(*env)
    zmm = 1 if _amd_family() >= 26 or _intel() else 20
    want = {"avx512bf16": zmm, "avx2": 8, "portable": 0}[tk.isa()]
    assert lane_rows() == want, f"{tk.isa()}, AMD family {_amd_family()}, Intel {_intel()}"


@pytest.mark.parametrize("wdtype,xdtype", [(torch.float32, torch.float32),
                                           (torch.float32, torch.bfloat16),
                                           (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("N,K,chunks", [(160, 256, 8), (72, 200, 4), (40, 64, 8), (48, 2048, 8),
                                        (17, 96, 2)])
def test_linear_with_groups_is_bitwise_in_place(N, K, chunks, wdtype, xdtype):
    """tk.linear given its weight's groups: every row count across the lane-pass threshold and
    the 256-row blocks, chunks of at most one lane step (kc <= 8) and with a lane one step
    longer than its pair, N not a multiple of 16 (an edge panel read in place), a bias, bf16
    out, bf16 x on fp32 weights and bf16 pair chains (one-row tiles on bf16 groups): the same
    bits as without."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(N, K, generator=g).to(wdtype)
    b = torch.randn(N, generator=g)
    groups = _packed(w, chunks)
    for M in (1, 2, 3, 5, 6, 7, 8, 9, 10, 13, 16, 17, 19, 20, 21, 31, 32, 33, 64, 257, 300):
        x = torch.randn(M, K, generator=g).to(xdtype)
        for bias, odt in ((None, None), (b, torch.bfloat16)):
            want = tk.linear(x, w, bias, chunks=chunks, out_dtype=odt)
            got = tk.linear(x, w, bias, chunks=chunks, out_dtype=odt, weight_groups=groups)
            assert_bitwise(got, want, f"M={M}, bias {bias is not None}")


@pytest.mark.parametrize("env", [None, ("TONP_FORCE_AVX2", "1"), ("TONP_FORCE_PORTABLE", "1")])
def test_linear_reads_fp32_groups_from_the_lane_pass_rows(env, monkeypatch):
    """The twin: groups packed from another weight change the rows whose tasks read them (so the
    equality above compares a path that reads them) and leave fewer rows, which read W in place,
    unchanged (where the table has fewer: from one row on an Intel's or a Zen 5's AVX-512 table, none); the
    portable table reads none. A forward that records gradients reads W."""
    g = torch.Generator().manual_seed(3)
    w, other = torch.randn(64, 256, generator=g), torch.randn(64, 256, generator=g)
    native = tk.pack_weight_groups(other, 8)    # this CPU's table's layout
    if env is not None:
        monkeypatch.setenv(*env)
    # Packed under the forced table (its lane order: a copy in another table's order is read in
    # place); the portable table packs none, so it is handed the native copy, which it ignores.
    og = tk.pack_weight_groups(other, 8)
    if og is None:
        og = native
    rows = lane_rows()
    x = torch.randn(max(rows, 1) + 5, 256, generator=g)
    got = tk.linear(x, w, weight_groups=og)
    want = tk.linear(x, w)
    if reads_groups(torch.float32):
        assert not torch.equal(got, want), f"{tk.isa()}: {rows} rows did not read the groups"
    else:
        assert_bitwise(got, want, "the portable table reads W in place")
    if rows > 1:
        few = x[:rows - 1]
        assert_bitwise(tk.linear(few, w, weight_groups=og), tk.linear(few, w), f"{rows - 1} rows: W")
        assert not torch.equal(tk.linear(x[:rows], w, weight_groups=og), tk.linear(x[:rows], w)), \
            f"{rows} rows did not read the groups"
    wr = w.clone().requires_grad_()
    assert_bitwise(tk.linear(x, wr, weight_groups=og).detach(), want, "training forward: W")


def test_linear_refuses_bad_groups_with_the_reason():
    w = torch.randn(32, 256)
    x = torch.randn(40, 256)
    g4 = tk.pack_weight_groups(w, 4)
    if g4 is not None:
        with pytest.raises(ValueError, match="weight_groups has shape .*pack_weight_groups of "
                                             "weight .* chunks=8"):
            tk.linear(x, w, weight_groups=g4)
        with pytest.raises(ValueError, match="weight_groups has shape"):
            tk.linear(x, torch.randn(48, 256), chunks=4, weight_groups=g4)
    with pytest.raises(TypeError, match="weight's dtype Float .*got BFloat16"):
        tk.linear(x, w, weight_groups=torch.zeros(8, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_layers_hold_fp32_groups_only_and_roll_out_the_same_bits(dtype):
    """In the model, the attention projections and the LM head hold groups of fp32 weights (and
    none of bf16 ones, where the one-row tiles read in place as fast); the engine reads them at
    a batch whose rows run lane passes: the same tokens and logprobs as an engine with none,
    logdiff 0 against the training forward. The twin: negated copies change that rollout."""
    from tonp_models.layers.embedding import LMHead
    from tonp_models.layers.linear import ColumnParallelLinear, RowParallelLinear
    m = tiny_model(dtype)
    g = torch.Generator().manual_seed(4)
    ps = [torch.randint(0, m.config.vocab_size, (5,), generator=g) for _ in range(lane_rows() + 3)]
    out = generate(m, ps, 3, max_batch_size=len(ps))
    dense = [d for d in m.modules() if isinstance(d, (ColumnParallelLinear, RowParallelLinear, LMHead))]
    assert dense and all(d.weight_groups_current() for d in dense)
    held = (dtype == torch.float32 and reads_groups(dtype))
    assert all((d.weight_group_bytes() > 0) == held for d in dense)
    without = generate(m, ps, 3, max_batch_size=len(ps), weight_groups=False)
    for a, b in zip(out.logprobs, without.logprobs, strict=True):
        assert_bitwise(a, b, "logprobs")
    for a, b in zip(out.sequences, without.sequences, strict=True):
        assert_bitwise(a, b, "tokens")
    assert rollout_logdiff(m, out, 0.0) == (0.0, True)
    if held:
        for d in dense:
            d._groups[1][0].neg_()          # a wrong copy, same key: read inside the engine
        try:
            bad = generate(m, ps, 3, max_batch_size=len(ps))
        finally:
            m.drop_weight_groups()          # the shared tiny model: no wrong copy left behind
        assert any(not torch.equal(a, b) for a, b in zip(bad.logprobs, out.logprobs))


def test_linear_reads_bf16_groups_in_the_one_row_tiles():
    """The bf16 twin: where the table reads bf16 groups, another weight's groups change a
    one-row bf16 x bf16 output (the one-row tiles read them), on Intel also 2-6 rows (pair
    tiles on the group), and leave one row more (read in place) unchanged."""
    g = torch.Generator().manual_seed(5)
    w, other = (torch.randn(64, 256, generator=g).bfloat16() for _ in range(2))
    og = _packed(other, 8)
    most = bf16_group_rows_max()
    x = torch.randn(most + 1, 256, generator=g).bfloat16()
    for rows in sorted({1, 2, 3, most} & set(range(1, most + 1))):
        assert not torch.equal(tk.linear(x[:rows], w, weight_groups=og), tk.linear(x[:rows], w)), \
            f"{rows} row(s) did not read the groups"
    assert_bitwise(tk.linear(x, w, weight_groups=og), tk.linear(x, w), f"{most + 1} rows: W in place")
