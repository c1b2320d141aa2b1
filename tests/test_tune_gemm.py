"""scripts/tune_gemm.py --smoke under Triton's CPU interpreter: the sweep still binds, checks and runs
every kind of GEMM it knows (the pipeline's two, and the TMA and warp-specialised GEMM1 variants),
so a change to a kernel's arguments cannot leave the tuning tool broken. Skipped without triton."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_tune_gemm_smoke_sweep_runs_every_kind(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, os.path.join(root, "scripts", "tune_gemm.py"), "--smoke", "--tma",
                             "--budget", "30", "--out", str(tmp_path)], cwd=root, env=env, capture_output=True,
                            text=True, timeout=600)
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert "not ok" not in out, out[-3000:]
    assert "configurations ran ok" in out
    for kind in ("gemm1: default", "gemm2: default", "gemm1 TMA weights: best", "gemm1 TMA rows+weights: best"):
        assert kind in out, (kind, out[-3000:])
    assert os.path.exists(tmp_path / "tune_gemm.json")
