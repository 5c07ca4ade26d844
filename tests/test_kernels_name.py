"""The checkout's kernels/ folder (tonp_kernels' source) and the installed package named `kernels`.

From the repository root, with the working directory on sys.path as `python -m pytest`, `python -c`
and `python -m tonp_models...` put it, `import kernels` finds this folder first. transformers >= 5.25
imports Hugging Face's `kernels` (it requires it) and setuptools loads that package's egg_info
writer while building tonp; the folder hands the name over, or is an empty module.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, *flags: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_installed_kernels_package_wins_from_the_checkout_root():
    import importlib.metadata as md
    try:
        md.version("kernels")
    except md.PackageNotFoundError:
        pytest.skip("no installed distribution named 'kernels' (transformers < 5.25 does not need it)")
    r = _run("import sys, kernels, kernels._internals; import tonp_kernels as tk\n"
             "from transformers import Qwen3MoeForCausalLM\n"
             "assert sys.path[0] == '', sys.path[0]\n"
             "print(kernels.__file__); print(tk.__file__)")
    assert r.returncode == 0, r.stderr
    hf, tonp = r.stdout.split()
    assert not Path(hf).resolve().is_relative_to(ROOT / "kernels"), hf  # Hugging Face's package
    assert Path(tonp).resolve().is_relative_to(ROOT / "kernels"), tonp  # this checkout's, editable


def test_without_an_installed_kernels_the_folder_is_an_empty_module():
    # -S: no site-packages, so no `kernels` but this folder. Loaded under that name it must not
    # run tonp_kernels (that would register torch.ops.tonp a second time) nor fail the import
    # (transformers < 5.25 imports it to read a version): an empty module, no submodules.
    r = _run("import kernels\n"
             "assert getattr(kernels, '__version__', 'N/A') == 'N/A'\n"
             "try:\n"
             "    import kernels._arg_checks\n"
             "    raise SystemExit('a submodule was found')\n"
             "except ModuleNotFoundError:\n"
             "    pass\n"
             "kernels.get_kernel", "-S")
    assert r.returncode != 0
    assert "AttributeError: module 'kernels' has no attribute 'get_kernel'" in r.stderr, r.stderr
    assert "import tonp_kernels" in r.stderr


def test_no_folder_tests_put_on_sys_path_holds_a_kernels_module():
    # Tests and scripts insert benchmarks/, examples/ and tests/ into sys.path; a kernels.py there
    # (benchmarks/kernels.py was one) shadows the installed package the same way.
    for d in ("benchmarks", "examples", "tests", "tonp_models", "tonp_parallel"):
        assert not (ROOT / d / "kernels.py").exists() and not (ROOT / d / "kernels").is_dir(), d
