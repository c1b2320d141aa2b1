"""The cross-node benchmark (ds_comet.bench.internode) runs on CPU and reports every chunk count."""

import json
import os
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_internode_bench_times_each_chunk_count(tmp_path):
    env = dict(os.environ, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), "-m", "ds_comet.bench.internode", "--custom", "64,96,4,2,48",
                           "--chunks", "1,rule,3", "--iters", "2", "--warmup", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.load(open(tmp_path / "internode.json"))["H64-F96-E4-k2-T48"]
    assert {count: entry["chunks"] for count, entry in results.items()} == {"1": 1, "rule": 2, "3": 3}
    assert all(entry["forward"] > 0 and entry["step"] > 0 for entry in results.values())
    assert "ratio" in done.stdout


def test_internode_bench_refuses_one_node(tmp_path):
    env = dict(os.environ, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), "-m", "ds_comet.bench.internode", "--custom", "64,96,4,2,48",
                           "--ranks-per-node", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert done.returncode != 0 and "are one node" in done.stdout + done.stderr
