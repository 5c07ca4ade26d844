"""tonp: true-on-policy model package.

`kernels/` is installed as the import package `tonp_kernels` (a top-level `kernels` would collide
with Hugging Face's `kernels` package). The C++ CPU kernels build as `tonp_kernels._C`, a torch
extension registered under `torch.ops.tonp`. Build without isolation: `pip install
--no-build-isolation -e .` (an isolated build would download a CUDA torch).
"""
import glob

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

# -ffp-contract=off: the compiler must never fuse a*b+c on its own (it would do so in one path and
# not in another); every FMA in the kernels is written out. No -ffast-math: no reassociation.
# -falign-loops=64: every loop starts on a cache line, so a kernel's speed no longer depends on
# where the linker happens to place it (on the Zen 3 the bf16 lane passes, byte for byte the same
# code, ran 106 or 132 GFLOP/s by placement alone; aligned, 131-136 in every build). Speed only.
CXX_FLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-fno-fast-math", "-falign-loops=64", "-fopenmp",
             "-Wall", "-Wno-unused-function"]

# The rollout service (tonp_models.serve); tonp's layers as megatron-core specs
# (tonp_models.megatron, whose modules use einops); the Triton kernels on GPUs (a CUDA torch
# usually ships triton) and on Ascend NPUs (torch_npu's device, Triton through triton-ascend);
# TRL's GRPOTrainer on tonp (tonp_models.integrations.trl); the test suite, which runs all.
EXTRAS = {
    "serve": ["fastapi>=0.110", "uvicorn>=0.30"],
    "megatron": ["megatron-core>=0.16,<0.17", "einops>=0.7"],
    "cuda": ["triton>=3.6"],
    "npu": ["torch_npu", "triton-ascend"],
    "trl": ["trl>=1.16,<2"],
}
EXTRAS["test"] = EXTRAS["serve"] + EXTRAS["megatron"] + EXTRAS["trl"] + [
    "pytest>=8", "pytest-timeout>=2.3", "transformers>=5,<6", "tokenizers>=0.20",
    "triton>=3.9,<4", "openai>=1.40", "httpx>=0.27", "lm-eval[api]>=0.4,<0.5"]

setup(
    name="tonp",
    version="0.1.0",
    description="True-on-policy Qwen3-MoE: one model for training and rollout, bitwise-equal logprobs",
    python_requires=">=3.10",
    packages=["tonp_kernels", "tonp_kernels.accel"] + find_packages(
        include=["tonp_models", "tonp_models.*", "tonp_parallel", "tonp_parallel.*"]),
    package_dir={"tonp_kernels": "kernels"},
    ext_modules=[
        CppExtension(
            name="tonp_kernels._C",
            sources=sorted(glob.glob("kernels/csrc/*.cpp")),
            extra_compile_args={"cxx": CXX_FLAGS},
            extra_link_args=["-fopenmp"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    install_requires=["torch>=2.4", "numpy", "safetensors", "tqdm"],
    extras_require=EXTRAS,
)
