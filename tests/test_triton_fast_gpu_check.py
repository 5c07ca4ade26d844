"""benchmarks/gpu_check.py cannot rot: its dry run (CPU tensors through Triton's interpreter, tiny
sizes) runs every section and writes the report, and a failing or overlong section is recorded
while the run goes on."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402  (imports torch and benchlib only: no kernels)

def test_the_dry_run_runs_every_section(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "TRITON_INTERPRET")}
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--out",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "gpu.json").read_text())
    by_name = {s["name"]: s for s in data["sections"]}
    assert len(by_name) == 13 and data["meta"]["dry"], list(by_name)
    for name, s in by_name.items():  # the model sections run through tk.use(numerics=...)
        assert s["status"] == "ok", (name, s["status"], s["error"])
    assert len(by_name["exact ops vs CPU"]["checks"]) >= 26
    assert len(by_name["fast kernels: invariances"]["checks"]) >= 25
    assert all(m["value"] is None for s in data["sections"] for m in s["metrics"])  # no timing
    assert "DRY RUN" in (tmp_path / "gpu.md").read_text()


def test_a_failing_or_overlong_section_is_recorded(tmp_path):
    args = argparse.Namespace(dry_run=True)
    far = time.time() + 100

    def differs(sec):
        sec.check("one", True)
        sec.check("two", False, "(detail)")

    def wrapped(sec):   # as Triton's interpreter re-raises what a kernel it runs raised
        try:
            time.sleep(5)
        except gpu_check.SectionTimeout as e:
            raise RuntimeError("InterpreterError('SectionTimeout()')") from e

    got = [gpu_check.run_section("boom", lambda sec: 1 / 0, 10, args, far),
           gpu_check.run_section("slow", lambda sec: time.sleep(5), 1.5, args, far),
           gpu_check.run_section("wrapped", wrapped, 1.5, args, far),
           gpu_check.run_section("late", lambda sec: None, 10, args, time.time()),
           gpu_check.run_section("differs", differs, 10, args, far)]
    assert [g["status"] for g in got] == ["error", "timeout", "timeout",
                                          "skipped: the run's time budget is spent", "differs"]
    assert "ZeroDivisionError" in got[0]["error"] and got[1]["seconds"] < 4 > got[2]["seconds"]
    md = gpu_check.markdown(got, {"when": "now", "dry": True, "seconds": 1.0})
    assert "ZeroDivisionError" in md and "- two (detail)" in md
