"""tonp_kernels.accel: Triton kernels (GPU; the CPU through TRITON_INTERPRET=1)."""
