"""tonp_kernels.accel: the tonp ops as Triton kernels, for CUDA / NPU tensors (and, through
Triton's interpreter with TRITON_INTERPRET=1 set before the kernels are imported, for CPU
tensors).

Two numerics (docs/accelerators.md): `exact`, every output performing the C++ kernel's fp32
operation sequence (the CPU's bits), for every op with a Triton kernel; `fast`, tensor-core
kernels for linear, attention and the MoE experts (the fast_* modules; the other ops keep their
exact kernel). Which module serves which op is the op table's (tonp_kernels/table.py), looked up
by `registry.kernel`; numerics holds the shared exp, log and trees. Importing this package alone
decorates none of the kernels.
"""
