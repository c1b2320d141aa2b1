"""The cross-node benchmark (ds_comet.bench.internode) runs on CPU and reports every chunk count."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bench(ranks, *args):
    """ds_comet.bench.internode on ``ranks`` CPU ranks with ``args``: the finished process."""
    env = dict(
        os.environ,
        DS_ACCELERATOR="cpu",
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(ranks),
        "--master_port",
        str(free_port()),
        "-m",
        "ds_comet.bench.internode",
        "--custom",
        "64,96,4,2,48",
        *args,
    ]
    # A session of its own, so that a run past its time is killed with its ranks (which could be
    # building an op: left running, they would race the next build in the same directory).
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"timed out after 300 s: {stderr[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def test_internode_bench_times_each_chunk_count(tmp_path):
    done = bench(2, "--chunks", "1,rule,3", "--iters", "2", "--warmup", "1", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.load(open(tmp_path / "internode.json"))["H64-F96-E4-k2-T48"]
    assert {count: entry["chunks"] for count, entry in results.items()} == {"1": 1, "rule": 2, "3": 3}
    assert all(entry["forward"] > 0 and entry["step"] > 0 for entry in results.values())
    assert "ratio" in done.stdout


def test_internode_bench_refuses_one_node(tmp_path):
    done = bench(2, "--ranks-per-node", "2", "--out", str(tmp_path))
    assert done.returncode != 0 and "are one node" in done.stdout + done.stderr
    done = bench(2, "--forwarding", "--out", str(tmp_path))
    assert done.returncode != 0 and "needs --ranks-per-node 2 or more" in done.stdout + done.stderr


def test_internode_bench_times_forwarding_inside_nodes(tmp_path):
    done = bench(
        4,
        "--ranks-per-node",
        "2",
        "--forwarding",
        "--chunks",
        "1,2",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--no-backward",
        "--out",
        str(tmp_path),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.load(open(tmp_path / "internode.json"))["H64-F96-E4-k2-T48"]
    assert {arm: (entry["chunks"], entry["ranks_per_node"]) for arm, entry in results.items()} == {
        "1": (1, None),
        "2": (2, None),
        "1 fwd": (1, 2),
        "2 fwd": (2, 2),
    }
    assert "1 fwd" in done.stdout
