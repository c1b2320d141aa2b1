"""scripts/tune_gemm.py --smoke under Triton's CPU interpreter: the sweep still binds, checks and runs
every kind of GEMM it knows (the pipeline's two, the TMA, warp-specialised and split-epilogue GEMM1
variants, two programs a multiprocessor, GEMM2's chunk counts), so a change to a kernel's arguments
cannot leave the tuning tool broken. Skipped without triton."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_tune_gemm_smoke_sweep_runs_every_kind(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1")
    command = [sys.executable, os.path.join(root, "scripts", "tune_gemm.py"), "--smoke", "--tma-only", "--ctas-per-sm",
               "1,2", "--gemm2-chunks", "1,2", "--budget", "120", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(tmp_path / "tune_gemm.json") as handle:
        shapes = json.load(handle)["shapes"]
    runs = [r for shape in shapes.values() for split in ("uneven", "balanced") for r in shape[split]["results"]]
    assert runs and all(r["status"] == "ok" for r in runs), [(r["label"], r["status"]) for r in runs
                                                            if r["status"] != "ok"]
    labels = {r["label"] for r in runs}
    for kind in ("gemm1", "gemm2", "gemm1_tma"):
        assert any(r["kind"] == kind for r in runs), kind
    for variant in (" tmaW ", " tmaA+W ", " ws ", " ws split ", " x2", " c1 "):
        assert any(variant in label for label in labels), (variant, sorted(labels))
    assert not any(shape["skipped"] for shape in shapes.values()), [shape["skipped"] for shape in shapes.values()]
