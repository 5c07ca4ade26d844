"""Every Python registration of the tonp ops, from the op table (table.py); imported once the C++
extension has defined the ops (their schemas, CPU kernels and C++ autograd: csrc/).

* Fake kernels (_fakes.py) for every op with tensors: meta tensors and torch.compile.
* CUDA and NPU (torch_npu's PrivateUse1) kernels, below the same C++ autograd as the CPU ones:
  - an op with a Triton forward kernel (`exact`): `accel.registry.kernel(op)`, the exact or
    the fast kernel of the calling context's numerics (Triton is imported at the first call);
  - a backward op on "device_grads": device_grads.py's torch math;
  - the experts' training ops (`device` an accel module): grouped Triton work where Triton runs
    on the device (moe_experts_train: the context's moe_experts kernel handing back its gate_up
    rows; the gradients: accel/moe_grad.py), device_grads.py's per-expert loop where it does not
    (an NPU without triton-ascend).
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
from typing import Callable, Dict

import torch

from . import _fakes, device_grads
from .table import OPS, TOOLS

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


def _device(args) -> torch.device:
    return next(a.device for a in args if isinstance(a, torch.Tensor))


def _triton_kernel(op: str) -> Callable:
    def run(*args):
        from .accel import registry
        dev = _device(args)
        if not _triton_runs_on(dev.type):
            raise NotImplementedError(f"tonp.{op}: {dev.type} tensors need the triton-ascend "
                                      "package for tonp's Triton kernels (not installed)")
        return registry.kernel(op)(*args)
    run.__name__ = f"{op}_triton"
    return run


def _grouped(op: str, module: str) -> Callable:
    """accel.<module>.<op> where Triton runs on the device; device_grads.<op> where it does not."""
    def run(*args):
        if _triton_runs_on(_device(args).type):
            return getattr(importlib.import_module(f"{__package__}.accel.{module}"), op)(*args)
        return getattr(device_grads, op)(*args)
    run.__name__ = f"{op}_triton"
    return run


def device_kernel(op: str) -> Callable:
    """The CUDA / NPU kernel the table gives `op`."""
    row = next(o for o in OPS if o.name == op)
    if row.exact:
        return _triton_kernel(op)
    if row.device == "device_grads":
        return getattr(device_grads, op)
    return _grouped(op, row.device)


_LIB = torch.library.Library("tonp", "IMPL")  # kept alive: dropping it unregisters
DEVICE_KERNELS: Dict[str, Callable] = {o.name: device_kernel(o.name) for o in OPS
                                       if o.exact or o.device}
for _o in OPS:
    if not _o.schema or _o.name in TOOLS:
        continue
    _name = f"tonp::{_o.name}"
    torch.library.register_fake(_name, getattr(_fakes, _o.name))
    for _key in _KEYS:  # once per process, even if this file is imported under a second name
        if _o.name in DEVICE_KERNELS and \
                not torch._C._dispatch_has_kernel_for_dispatch_key(_name, _key):
            _LIB.impl(_o.name, DEVICE_KERNELS[_o.name], _key)
