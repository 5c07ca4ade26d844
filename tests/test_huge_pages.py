"""Weights on 2 MB pages (tonp_kernels.on_huge_pages; big_alloc.cpp empty_huge): every decode
step streams the weights whole, and on 4 KB pages it walks a page-table entry every 4 KB. The
model's weights and the experts' column groups live in memory 2 MB aligned with transparent huge
pages requested. Where the bytes live changes no bit: the copies are exact and the model reads
them as it read the originals."""
from __future__ import annotations

import copy
import pathlib

import pytest
import torch

import tonp_kernels as tk
from conftest import assert_bitwise
from tonp_models import Qwen3MoeConfig, Qwen3MoeForCausalLM

HUGE = 2 << 20
THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % HUGE == 0


def _huge_kb(t: torch.Tensor) -> int:
    """AnonHugePages (kB) of the mapping that holds t's first byte (/proc/self/smaps)."""
    addr, inside = t.data_ptr(), False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_huge_pages_is_an_exact_contiguous_copy_2mb_aligned(dtype):
    g = torch.Generator().manual_seed(0)
    # 6-12 MB, one element past its allocation's start: never at a 2 MB boundary (a tensor there
    # is returned as it is; the allocator places a fresh one there now and then)
    w = torch.randn(1536 * 2048 + 1, generator=g).to(dtype)[1:].view(1536, 2048)
    w.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40]).to(dtype)
    h = tk.on_huge_pages(w)
    assert h is not w and _aligned(h) and h.is_contiguous() and h.dtype == dtype
    bits = torch.int32 if dtype == torch.float32 else torch.int16   # NaN too, by its bits
    assert_bitwise(h.view(bits), w.view(bits), "the copy")
    t = torch.randn(2048, 1536, generator=g).t()                  # a transposed view
    ht = tk.on_huge_pages(t)
    assert ht.is_contiguous() and _aligned(ht)
    assert_bitwise(ht, t, "a view's copy")
    assert tk.on_huge_pages(h) is h                               # already there: no copy


def test_on_huge_pages_leaves_small_and_non_cpu_tensors_and_refuses_others():
    small = torch.randn(1023, 1024)                               # under 4 MB
    assert tk.on_huge_pages(small) is small
    meta = torch.empty(4096, 4096, device="meta")
    assert tk.on_huge_pages(meta) is meta
    with pytest.raises(TypeError, match="on_huge_pages: expected a tensor, got list"):
        tk.on_huge_pages([1.0])
    with pytest.raises(ValueError, match="huge_pages_copy: expected a CPU tensor"):
        torch.ops.tonp.huge_pages_copy(meta)


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                    reason="this kernel has transparent huge pages off: the copies are plain memory")
def test_the_copy_is_backed_by_huge_pages():
    """Where the kernel offers transparent huge pages (enabled: always or madvise), the copy's
    mapping holds them once written, even where malloc's heap holds pages freed by tensors
    before it (already faulted in as 4 KB pages: advice would not change them)."""
    for _ in range(3):
        torch.ones(4096, 2048)                                    # freed at once
        tk.on_huge_pages(torch.ones(2048, 2048))
    h = tk.on_huge_pages(torch.ones(4096, 2048))                  # 32 MB
    assert _huge_kb(h) >= 2048, "no 2 MB page backs the copy"


def _model(dtype=torch.float32):
    # vocab 16384 x hidden 64: a 4 MB (fp32) embedding and LM head, the rest small
    cfg = Qwen3MoeConfig.preset("tiny", vocab_size=16384, num_hidden_layers=1)
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg, dtype=dtype).eval()


def test_the_model_keeps_its_large_weights_on_huge_pages_with_the_same_bits(tmp_path):
    """The constructor and from_pretrained move every weight of 4 MB or more (the same Parameter
    objects); a deepcopy on plain pages gives the same logits bit for bit."""
    m = _model()
    big = {n for n, p in m.named_parameters() if p.numel() * p.element_size() >= tk.ops.HUGE_PAGE_MIN_BYTES}
    assert big >= {"embed_tokens.weight", "lm_head.weight"}
    assert all(_aligned(p) for n, p in m.named_parameters() if n in big)
    plain = copy.deepcopy(m)
    assert not all(_aligned(p) for n, p in plain.named_parameters() if n in big)
    ids = torch.randint(0, 16384, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_bitwise(m(ids), plain(ids), "logits, huge pages against plain pages")
    m.save_pretrained(tmp_path)
    loaded = Qwen3MoeForCausalLM.from_pretrained(tmp_path)
    assert all(_aligned(p) for n, p in loaded.named_parameters() if n in big)
    for (n, a), b in zip(m.named_parameters(), loaded.parameters(), strict=True):
        assert_bitwise(b, a, n)
    params, ptrs = list(m.parameters()), [p.data_ptr() for p in m.parameters()]
    m.weights_to_huge_pages()                                     # again: nothing to copy
    assert list(m.parameters()) == params and all(p.requires_grad for p in params)
    assert [p.data_ptr() for p in m.parameters()] == ptrs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_groups_are_made_on_huge_pages(dtype):
    g = tk.pack_weight_groups(torch.randn(4, 1536, 1024).to(dtype), 8)
    if g is None:
        assert tk.isa() == "portable" or (tk.isa() == "avx2" and dtype == torch.bfloat16)
        pytest.skip(f"the {tk.isa()} build reads no {dtype} weight groups")
    assert _aligned(g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kv_cache_keeps_its_pages_on_huge_pages(dtype):
    """Decode reads a sequence's pages scattered, a head's slice of each position a cache row
    apart: each layer's K and V pages of 4 MB or more live 2 MB aligned, zeroed, with the cache's
    shape and dtype; a pipeline stage's empty layers stay as they are."""
    from tonp_models.layers.kv_cache import PagedKVCache
    cache = PagedKVCache(3, 4, 128, page_size=64, num_pages=64, max_seqs=4, max_seq_len=1024,
                         dtype=dtype, layers=(0, 2))      # 64 pages x 64 KB (fp32): 4 MB a layer
    for layer in (0, 2):
        for t in (cache.k[layer], cache.v[layer]):
            assert _aligned(t) and t.is_contiguous() and t.dtype == dtype
            assert t.shape == (64, 64, 4, 128) and not bool(t.any())
    assert cache.k[1].shape == (0, 64, 4, 128)
