"""The Triton kernels (accel/) as the tonp ops' kernels on accelerators, and the route of CPU
tensors through them under Triton's interpreter.

* CUDA and NPU (torch_npu's PrivateUse1) tensors: each op of accel.registry.OPS gets, for those
  dispatch keys, a kernel that runs `registry.kernel(op)`: the exact or the fast Triton kernel
  of the calling context's numerics. The C++ autograd of the ops (csrc/autograd.cpp) sits above
  it, as it does above the CPU kernels. Triton is imported at the first such call. The backward
  ops get device_grads.py's torch-math kernels for the same keys, but the experts': wherever
  Triton runs on the device, moe_experts_train is the moe_experts kernel handing back its
  grouped gate_up rows, and the gradients are grouped Triton GEMMs (accel/moe_grad.py).
* CPU tensors under `use(..., backend="triton")` (or TONP_ACCEL_ON_CPU=1): `on_cpu(fn)` runs the
  invariant backend's function inside a dispatch mode that sends every tonp op to the same
  Triton kernels, interpreted (TRITON_INTERPRET=1 is set before the kernels are first imported;
  a process that imported them compiled cannot interpret them).
"""
from __future__ import annotations

import functools
import importlib.metadata
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .accel.registry import OPS
from .device_grads import KERNELS as _GRADS

DEVICE_TYPES = ("cuda", "npu")  # ROCm tensors are "cuda" too; torch_npu's device is "npu"
_KEYS = ("CUDA", "PrivateUse1")


@functools.lru_cache(maxsize=None)
def _triton_runs_on(device_type: str) -> bool:
    """NVIDIA / AMD GPUs: Triton's own backends. Ascend NPUs: the triton-ascend backend."""
    if device_type != "npu":
        return True
    try:
        importlib.metadata.distribution("triton-ascend")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def _device_kernel(op: str):
    def run(*args):
        from .accel import registry
        dev = next(a.device for a in args if isinstance(a, torch.Tensor))
        if not _triton_runs_on(dev.type):
            raise NotImplementedError(f"tonp.{op}: {dev.type} tensors need the triton-ascend "
                                      "package for tonp's Triton kernels (not installed)")
        return registry.kernel(op)(*args)
    run.__name__ = f"{op}_triton"
    return run


def _moe_experts_train(x, expert_ids, gate_up, down, first_expert, chunks):
    """(y, gate_up rows): the context's moe_experts kernel (exact or fast) handing back the
    grouped gate_up rows it computed: y has the forward's bits, the rows cost nothing more."""
    from .accel import registry
    return registry.kernel("moe_experts")(x, expert_ids, gate_up, down, first_expert, chunks,
                                          gate_up_rows=True)


def _moe_grad(op: str):
    def run(*args):
        from .accel import moe_grad
        return getattr(moe_grad, op)(*args)
    return run


# The experts' training ops where Triton runs on the device: grouped launches, no expert loop.
_TRITON_TRAIN = {"moe_experts_train": _moe_experts_train,
                 "moe_experts_grad": _moe_grad("moe_experts_grad"),
                 "moe_experts_backward": _moe_grad("moe_experts_backward")}


def _grouped(op: str):
    """op's Triton version (_TRITON_TRAIN) where Triton runs on the device; device_grads'
    per-expert torch math where it does not (an NPU without triton-ascend)."""
    def run(*args):
        dev = next(a.device for a in args if isinstance(a, torch.Tensor))
        return (_TRITON_TRAIN if _triton_runs_on(dev.type) else _GRADS)[op](*args)
    run.__name__ = f"{op}_triton"
    return run


_LIB = torch.library.Library("tonp", "IMPL")  # kept alive: dropping it unregisters
# The forward ops on Triton; the backward ops on torch math (device_grads.py) but the experts'.
_GROUPED = {op: _grouped(op) for op in _TRITON_TRAIN}
for _op, _fn in {**{op: _device_kernel(op) for op in OPS}, **_GRADS, **_GROUPED}.items():
    for _key in _KEYS:  # once per process, even if this file is imported under a second name
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"tonp::{_op}", _key):
            _LIB.impl(_op, _fn, _key)


class _TritonOnCPU(TorchDispatchMode):
    """Every tonp op of OPS on the Triton kernels (interpreted on CPU tensors); the rest as is."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name.startswith("tonp::") and name[6:] in OPS:
            from .accel import registry
            return registry.kernel(name[6:])(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def require_interpreter() -> None:
    """Import the kernels interpreted (setting TRITON_INTERPRET=1 first), or explain why not."""
    if "tonp_kernels.accel._launch" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    from .accel import _launch
    if not _launch.INTERPRETED:
        raise RuntimeError("tonp_kernels: backend='triton' runs CPU tensors through Triton's "
                           "interpreter, but this process imported tonp's Triton kernels "
                           "compiled; set TRITON_INTERPRET=1 before the first tonp_kernels call")


def on_cpu(fn):
    """fn (an invariant-backend function) with its tonp ops on the interpreted Triton kernels."""
    require_interpreter()

    def run(*args):
        with _TritonOnCPU():
            return fn(*args)
    return run
