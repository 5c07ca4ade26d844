"""The op table (tonp_kernels/table.py) is the whole truth: every torch.ops.tonp op is a row,
every implementation a row names exists and is the one registered or dispatched, and
docs/kernels.md shows the table as it is. The constants the C++ side owns are read from it."""
from __future__ import annotations

import inspect
import pathlib

import pytest
import torch

import tonp_kernels as tk
from tonp_kernels import _dispatch, _fakes, _register, device_grads, invariant, stock, table
from triton_interpreted import registry

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "kernels.md"


def test_every_tonp_op_is_a_row_and_every_schema_row_an_op():
    defined = {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names()
               if n.startswith("tonp::")}
    assert defined == {o.name for o in table.OPS if o.schema}


def test_each_named_implementation_exists_and_is_the_one_in_use():
    for o in table.OPS:
        if o.wrapper:
            assert o.name in tk.__all__ and getattr(tk, o.name).__module__ == \
                f"tonp_kernels.{o.wrapper}", o.name
        assert hasattr(stock, o.name) == o.stock, o.name
        if o.name in table.DISPATCHED:
            assert _dispatch._INVARIANT[o.name] is getattr(invariant, o.name)
            assert _dispatch._STOCK.get(o.name) is (getattr(stock, o.name) if o.stock else None)
        if o.schema and o.name not in table.TOOLS:
            fake = getattr(_fakes, o.name)
            assert list(inspect.signature(fake).parameters) == [
                a.name for a in getattr(torch.ops.tonp, o.name).default._schema.arguments], o.name
        for name in o.backward + o.calls:
            assert table.BY_NAME[name].schema, (o.name, name)
        for key in ("CUDA", "PrivateUse1") if o.schema else ():
            has = torch._C._dispatch_has_kernel_for_dispatch_key(f"tonp::{o.name}", key)
            assert has == bool(o.exact or o.device), (o.name, key)
        if o.exact:
            assert registry.exact(o.name).__module__ == f"tonp_kernels.accel.{o.exact}"
        if o.fast:
            assert registry.fast(o.name).__module__ == f"tonp_kernels.accel.{o.fast}"
        if o.device == "device_grads":
            assert _register.DEVICE_KERNELS[o.name] is getattr(device_grads, o.name)
        elif o.device:
            assert hasattr(device_grads, o.name), f"{o.name}: no fallback without Triton"
    assert set(registry.fast_kernels()) == {o.name for o in table.OPS if o.fast}


def test_the_doc_shows_the_table_as_it_is():
    text = DOC.read_text()
    assert table.markdown() in text, \
        "docs/kernels.md: paste in the table `python -m tonp_kernels.table` prints"
    for o in table.OPS:
        assert f"`{o.name}`" in text, o.name


def test_the_chunk_limit_and_float_dtypes_are_the_cpp_sides():
    assert tk.MAX_CHUNKS == torch.ops.tonp.max_chunks() == 64
    assert tk.FLOAT_DTYPES == (torch.float32, torch.bfloat16)
    x, w = torch.randn(2, 2 * tk.MAX_CHUNKS), torch.randn(3, 2 * tk.MAX_CHUNKS)
    assert tk.linear(x, w, chunks=tk.MAX_CHUNKS).shape == (2, 3)
    for mode in ("invariant", "torch"):  # one limit: the C++ op's and the Python checks'
        with tk.use(mode), pytest.raises(ValueError, match="chunks"):
            tk.linear(x, w, chunks=2 * tk.MAX_CHUNKS)
    with pytest.raises(ValueError, match=f"at most {tk.MAX_CHUNKS} reduction chunks"):
        torch.ops.tonp.linear(x, w, None, 2 * tk.MAX_CHUNKS, None)
    for dtype in (torch.float16, torch.float64):
        with pytest.raises(TypeError, match="float32 or bfloat16"):
            torch.ops.tonp.linear(x.to(dtype), w.to(dtype), None, 8, None)
