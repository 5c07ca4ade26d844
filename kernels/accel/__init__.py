"""tonp_kernels.accel: the ops of tonp_kernels as Triton kernels, for GPUs (and, through Triton's
interpreter with TRITON_INTERPRET=1 set before the kernels are imported, for CPU tensors).

`exact` numerics (this package today): each output performs the C++ kernel's fp32 operation
sequence, so its bits equal the CPU's (docs/accelerators.md). The kernels live in the submodules
(linear, moe, rowwise, attention, vocab; numerics holds the shared exp, log and trees); importing
this package alone decorates none of them.
"""
