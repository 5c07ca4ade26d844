"""benchmarks/parallel_bench.py runs end to end at smoke size (2 gloo ranks, one repeat): the
training-step, rollout and CP tables with their ratios. No timing is asserted: this only
guards against the benchmark rotting."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.timeout(300)
def test_parallel_bench_smoke_writes_report(tmp_path):
    import parallel_bench
    md = parallel_bench.main(["--smoke", "--out", str(tmp_path)])
    for title in ("## Training step: PP 2 (1F1B) against PP 1 x DP 2", "## Rollout (generate, 4 prompts",
                  "CP 2 against CP 1", "| PP 2, 1F1B, M=2 |", "| CP 2 |", "Load average"):
        assert title in md, title
    assert (tmp_path / "parallel_smoke.json").exists()
