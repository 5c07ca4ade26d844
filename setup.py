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
CXX_FLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-Wall",
             "-Wno-unused-function"]

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
    install_requires=["torch>=2.4", "einops", "numpy", "safetensors", "tqdm"],
    extras_require={
        "test": ["pytest", "pytest-timeout", "transformers>=5", "megatron-core"],
        "megatron": ["megatron-core"],
        "trl": ["trl>=1.16,<2"],
        "npu": ["torch_npu"],
        "cuda": ["apex", "transformer-engine"],
    },
)
