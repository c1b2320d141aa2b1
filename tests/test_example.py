"""examples/train_moe.py end to end: CPU ranks under torchrun, the deepspeed launcher and mpirun.

The runs have DS_COMET_TEST_WORLD_SIZE ranks (2 when unset); the example takes its expert-parallel
size and expert count from the world size.

Every run uses the same seed and model, and the example draws its data and the gate's noise from
(seed, rank, step), so the runs must agree with one another step by step: a resumed run with the
uninterrupted one, mpirun with torchrun, and the comet backend with stock DeepSpeed's. Runs are
shared between tests through module-scoped fixtures; the whole file takes about two and a half
minutes on two cores (the first launch on a machine also JIT-builds DeepSpeed's shm comm op).
"""

import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from dist_pool import cpu_world_size, free_port, remove_shm_buffers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "examples", "train_moe.py")
CONFIGS = os.path.join(REPO, "configs")
TIMEOUT_S = 300
RANKS = cpu_world_size()
STEPS = 30
LOG_LINE = re.compile(r"^step (\d+) \| loss ([0-9.]+) \| aux ([0-9.]+) \| tokens/s (\d+)$", re.MULTILINE)
# The launchers' rank environment must come from the launcher under test, not from this process.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


def config(name):
    return os.path.join(CONFIGS, f"{name}.json")


class Run:
    """One finished launch: its combined output, its metrics file and its wall time."""

    def __init__(self, cmd, output, metrics_path, seconds):
        self.cmd, self.output, self.seconds = cmd, output, seconds
        self.records = []
        if metrics_path and os.path.exists(metrics_path):
            with open(metrics_path) as handle:
                self.records = [json.loads(line) for line in handle if line.strip()]

    @property
    def losses(self):
        """{step: loss} from the metrics file."""
        return {r["step"]: r["loss"] for r in self.records if "loss" in r}

    @property
    def logged(self):
        """[(step, loss, aux, tokens/s)] from the printed log lines."""
        return [(int(s), float(l), float(a), int(t)) for s, l, a, t in LOG_LINE.findall(self.output)]

    def value(self, label):
        match = re.search(rf"^{label} ([0-9.]+)", self.output, re.MULTILINE)
        return float(match.group(1)) if match else None

    def tail(self, chars=5000):
        return f"\n$ {' '.join(self.cmd)}\n--- output tail ---\n{self.output[-chars:]}"


def launch(cmd, port, metrics_path=None, env_extra=None) -> Run:
    """Runs the example's launch command; port is its MASTER_PORT (its /dev/shm buffers are removed after)."""
    try:
        return _launch(cmd, metrics_path, env_extra)
    finally:
        remove_shm_buffers(port)


def _launch(cmd, metrics_path, env_extra) -> Run:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    # A CPU test everywhere: gloo ranks in fp32, also on a machine with GPUs (where the example
    # would otherwise train in bf16 over NCCL and the runs would no longer agree bit for bit).
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu",
               PYTHONPATH=os.pathsep.join([REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env.update(env_extra or {})
    start = time.perf_counter()
    # A session of its own, so that a run past its time is killed with all the ranks it started.
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True, errors="replace")
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        run = Run(cmd, output, None, time.perf_counter() - start)
        pytest.fail(f"timed out after {TIMEOUT_S} s{run.tail()}")
    run = Run(cmd, output, metrics_path, time.perf_counter() - start)
    assert proc.returncode == 0, f"exit status {proc.returncode}{run.tail()}"
    return run


def example_args(ds_config, metrics_path, steps=STEPS, *extra):
    return [SCRIPT, "--deepspeed_config", config(ds_config), "--steps", str(steps), "--log-interval", "1",
            "--eval-batches", "2", "--metrics-file", str(metrics_path), *extra]


def torchrun(tmp_dir, name, ds_config, steps=STEPS, *extra) -> Run:
    metrics = os.path.join(tmp_dir, f"{name}.jsonl")
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(RANKS), "--master_port",
           str(port)] + example_args(ds_config, metrics, steps, *extra)
    return launch(cmd, port, metrics)


def assert_same_losses(run, reference, steps, tol, what):
    ours, theirs = run.losses, reference.losses
    missing = [s for s in steps if s not in ours or s not in theirs]
    assert not missing, f"{what}: no loss logged for steps {missing}{run.tail()}"
    worst = max(steps, key=lambda s: abs(ours[s] - theirs[s]))
    diff = abs(ours[worst] - theirs[worst])
    assert diff <= tol, (f"{what}: loss at step {worst} is {ours[worst]:.6f}, expected {theirs[worst]:.6f} "
                         f"(|diff| {diff:.2e} > {tol:g}){run.tail()}")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("train_moe"))


@pytest.fixture(scope="module")
def comet_run(workdir):
    """The reference run: torchrun, RANKS ranks, ZeRO-2, comet backend, STEPS steps."""
    return torchrun(workdir, "comet_zero2", "zero2_comet")


@pytest.fixture(scope="module")
def stock_run(workdir):
    return torchrun(workdir, "deepspeed_zero2", "zero2_deepspeed")


def assert_learns(run):
    losses = run.losses
    assert sorted(losses) == list(range(1, STEPS + 1)), f"steps logged: {sorted(losses)}{run.tail()}"
    start = sum(losses[s] for s in (1, 2, 3)) / 3
    end = sum(losses[s] for s in range(STEPS - 4, STEPS + 1)) / 5
    # A uniform guess over 256 bytes costs ln 256 = 5.55; byte frequencies alone bring it near 3.
    assert start > 5.0, f"first losses {start:.3f}: the model does not start from scratch{run.tail()}"
    assert end < 3.6 and end < start - 1.5, f"loss went from {start:.3f} to only {end:.3f}{run.tail()}"
    assert all(math.isfinite(v) for v in losses.values())
    return start, end


def test_torchrun_zero2_comet_learns(comet_run):
    start, end = assert_learns(comet_run)
    # The printed log lines and the metrics file say the same thing.
    logged = comet_run.logged
    assert [s for s, *_ in logged] == list(range(1, STEPS + 1)), comet_run.tail()
    for step, loss, aux, tokens_per_s in logged:
        assert abs(loss - comet_run.losses[step]) < 1e-3
        assert 0 < aux < 10 and tokens_per_s > 0
    final, evaluated = comet_run.value("final loss"), comet_run.value("eval loss")
    assert final is not None and abs(final - comet_run.losses[STEPS]) < 1e-3, comet_run.tail()
    assert evaluated is not None and evaluated < 4.0, f"eval loss {evaluated}{comet_run.tail()}"
    summary = comet_run.records[-1]
    assert summary.get("eval_loss") is not None and abs(summary["eval_loss"] - evaluated) < 1e-3
    assert "backend comet" in comet_run.output, comet_run.tail()
    # The metrics file: a start record, one record per step, then train_end and eval.
    events = [r.get("event") for r in comet_run.records]
    assert events == ["start"] + [None] * STEPS + ["train_end", "eval"], events
    header = comet_run.records[0]
    assert (header["backend"], header["zero_stage"], header["world_size"], header["dtype"]) == \
        ("comet", 2, 2, "float32"), header
    assert header["tokens_per_step"] == 2 * 8 * 64, header
    lrs = [r["lr"] for r in comet_run.records[1:STEPS + 1]]
    assert lrs[0] < lrs[4] == lrs[-1], f"learning rates {lrs[:6]}: the 5-step warm-up is not what was used"
    train_end = comet_run.records[-2]
    assert train_end["timing_from"] == 5 and train_end["timed_steps"] == STEPS - 5, train_end
    assert train_end["steady_tokens_per_s"] > 0, train_end
    assert abs(train_end["final_loss"] - comet_run.losses[STEPS]) < 1e-9, train_end
    assert train_end["peak_mem_mib"] is None, "peak GPU memory reported on CPU"
    throughput = comet_run.value("throughput")
    assert throughput is not None and abs(throughput - train_end["steady_tokens_per_s"]) < 1, comet_run.tail()
    print(f"\ntorchrun zero2_comet: loss {start:.3f} -> {end:.3f}, eval {evaluated:.3f}, "
          f"{comet_run.seconds:.0f} s")


def test_deepspeed_launcher_zero1_comet(workdir, comet_run):
    steps = 10
    metrics = os.path.join(workdir, "launcher_zero1.jsonl")
    deepspeed_cli = shutil.which("deepspeed")
    if deepspeed_cli is None:
        pytest.skip("the deepspeed launcher is not on PATH")
    port = free_port()
    cmd = [deepspeed_cli, "--num_gpus", str(RANKS), "--master_port", str(port)] + example_args(
        "zero1_comet", metrics, steps)
    run = launch(cmd, port, metrics)
    assert sorted(run.losses) == list(range(1, steps + 1)), run.tail()
    assert [s for s, *_ in run.logged] == list(range(1, steps + 1)), run.tail()
    assert f"world size {RANKS} " in run.output, run.tail()
    # Same seed, same data: ZeRO-1 under the deepspeed launcher follows ZeRO-2 under torchrun
    # (up to the order of floating-point sums in the gradient reduction).
    assert_same_losses(run, comet_run, range(1, steps + 1), 0.02, "deepspeed launcher, ZeRO-1")
    assert run.losses[steps] < run.losses[1] - 0.5, run.tail()
    print(f"\ndeepspeed launcher zero1_comet: {run.losses[1]:.3f} -> {run.losses[steps]:.3f}, {run.seconds:.0f} s")


def mpirun_command():
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        pytest.skip("mpirun is not on PATH (pip install mpich, or install Open MPI)")
    version = subprocess.run([mpirun, "--version"], capture_output=True, text=True).stdout
    cmd = [mpirun, "-np", str(RANKS)]
    if "Open MPI" in version or "OpenRTE" in version:
        cmd += ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    return cmd


def test_mpirun_zero2_comet(workdir, comet_run):
    steps = 10
    metrics = os.path.join(workdir, "mpirun.jsonl")
    cmd = mpirun_command() + [sys.executable] + example_args("zero2_comet", metrics, steps)
    # The example takes the ranks from the MPI launcher's variables, MASTER_PORT from the environment
    # and MASTER_ADDR 127.0.0.1 (none given).
    port = free_port()
    run = launch(cmd, port, metrics, env_extra={"MASTER_PORT": str(port)})
    assert f"world size {RANKS} " in run.output, run.tail()
    assert f"ranks from the MPI launcher's environment (MASTER_ADDR 127.0.0.1, MASTER_PORT {port})" in run.output, \
        run.tail()
    assert sorted(run.losses) == list(range(1, steps + 1)), run.tail()
    assert_same_losses(run, comet_run, range(1, steps + 1), 1e-3, "mpirun against torchrun")
    print(f"\nmpirun zero2_comet: {run.losses[1]:.3f} -> {run.losses[steps]:.3f}, {run.seconds:.0f} s")


def test_save_and_resume(workdir, comet_run):
    save_at = 15
    save_dir = os.path.join(workdir, "checkpoints")
    first = torchrun(workdir, "resume", "zero2_comet", save_at, "--save-dir", save_dir, "--save-interval", "5")
    assert {"latest", "step5", "step10", "step15"} <= set(os.listdir(save_dir)), os.listdir(save_dir)
    with open(os.path.join(save_dir, "latest")) as handle:
        assert handle.read().strip() == f"step{save_at}"
    assert_same_losses(first, comet_run, range(1, save_at + 1), 1e-3, "first half")

    second = torchrun(workdir, "resume", "zero2_comet", STEPS, "--save-dir", save_dir, "--resume")
    assert f"at step {save_at}" in second.output, second.tail()
    logged_steps = [s for s, *_ in second.logged]
    assert logged_steps and logged_steps[0] == save_at + 1 and logged_steps[-1] == STEPS, second.tail()
    # The metrics file was appended to: one history, steps 1..STEPS, from the two runs.
    assert sorted(second.losses) == list(range(1, STEPS + 1)), second.tail()
    # Model, optimizer (Adam moments), scheduler, data and gate noise all resume: the second half
    # follows the uninterrupted run.
    assert_same_losses(second, comet_run, range(save_at + 1, STEPS + 1), 1e-3, "resumed run")
    assert os.path.isdir(os.path.join(save_dir, f"step{STEPS}"))
    print(f"\nresume at {save_at}: loss {second.losses[save_at + 1]:.4f} at step {save_at + 1} "
          f"(uninterrupted {comet_run.losses[save_at + 1]:.4f}), {first.seconds:.0f} s + {second.seconds:.0f} s")


def test_stock_backend_zero2(stock_run):
    start, end = assert_learns(stock_run)
    assert "backend deepspeed" in stock_run.output, stock_run.tail()
    assert stock_run.value("eval loss") is not None, stock_run.tail()
    print(f"\ntorchrun zero2_deepspeed: loss {start:.3f} -> {end:.3f}, {stock_run.seconds:.0f} s")


def test_comet_backend_matches_stock(comet_run, stock_run):
    # The comet layer computes what stock DeepSpeed's does (same gate, same experts, fp32), so
    # with the same seeds the two backends train along the same loss curve.
    assert_same_losses(comet_run, stock_run, range(1, STEPS + 1), 1e-3, "comet backend against stock DeepSpeed")


# --------------------------------------------------------------------------------------------
# Fast checks without a launch: rank discovery under mpirun, the GPU preset and configs, and the
# checks scripts/train_compare.sh relies on to fail loudly on the GPU machine.
# --------------------------------------------------------------------------------------------


def load_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    return load_module("train_moe_example", SCRIPT)


@pytest.fixture(scope="module")
def plot_losses():
    return load_module("plot_losses", os.path.join(REPO, "scripts", "plot_losses.py"))


def test_ranks_from_mpi_launcher_env(example):
    openmpi = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
               "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29575"}
    env = dict(openmpi)
    assert example.adopt_mpi_launcher_env(env)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")} == dict(
        RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29575")
    hydra = {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    env = dict(hydra)
    example.adopt_mpi_launcher_env(env)
    assert (env["RANK"], env["LOCAL_RANK"], env["MASTER_ADDR"], env["MASTER_PORT"]) == ("0", "0", "127.0.0.1", "29500")
    # A launcher that set the ranks itself, and multi-node jobs, are left alone.
    env = dict(openmpi, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")
    assert not example.adopt_mpi_launcher_env(env) and env["RANK"] == "0"
    env = dict(openmpi, OMPI_COMM_WORLD_SIZE="4")
    assert not example.adopt_mpi_launcher_env(env) and "RANK" not in env


def test_gpu_preset_and_configs(example):
    args = example.parse_args(["--preset", "gpu", "--deepspeed_config", "x.json", "--layers", "2"])
    assert (args.layers, args.hidden, args.ffn, args.experts, args.k, args.seq_len) == (2, 1024, 4096, 8, 2, 1024)
    assert example.parse_args(["--deepspeed_config", "x.json"]).hidden == 64  # no preset: the small CPU model
    fine = example.parse_args(["--preset", "gpu-fine", "--deepspeed_config", "x.json", "--k", "2"])
    assert (fine.hidden, fine.ffn, fine.experts, fine.k, fine.seq_len) == (2048, 1408, 64, 2, args.seq_len)
    import ds_comet
    for stage in (1, 2):
        for backend in ("comet", "deepspeed"):
            path = config(f"gpu_zero{stage}_{backend}")
            with open(path) as handle:
                ds_config = json.load(handle)
            moe = ds_comet.moe_config_from(ds_config)
            assert moe.backend == backend and ds_config["zero_optimization"]["stage"] == stage, path
            assert ds_config["bf16"]["enabled"] is True, path
            # The fused workspace holds one layer call of the preset: micro batch x window.
            assert moe.max_tokens_per_rank == ds_config["train_micro_batch_size_per_gpu"] * args.seq_len == 8192, path


def write_metrics(path, losses, lrs=None, start_step=0):
    with open(path, "a") as handle:
        handle.write(json.dumps({"event": "start", "start_step": start_step, "backend": "comet"}) + "\n")
        for step, loss in losses.items():
            handle.write(json.dumps({"step": step, "loss": loss, "lr": (lrs or {}).get(step, 1e-3)}) + "\n")
        handle.write(json.dumps({"event": "train_end", "steady_tokens_per_s": 1000.0, "peak_mem_mib": 10.0,
                                 "final_loss": loss}) + "\n")


def test_resume_check_catches_a_bad_resume(tmp_path, plot_losses, capsys):
    full = {s: 5.0 - 0.05 * s for s in range(1, 21)}
    write_metrics(tmp_path / "full.jsonl", full)
    check = ["resume-check", "--full", str(tmp_path / "full.jsonl"), "--from-step", "10"]

    def resumed(name, **kwargs):
        path = tmp_path / name
        write_metrics(path, {s: full[s] for s in range(1, 11)})  # the first run appended to, as the example does
        losses = {s: full[s] + kwargs.get("shift", 0.0) for s in range(11, 21)}
        write_metrics(path, losses, kwargs.get("lrs"), kwargs.get("start_step", 10))
        return plot_losses.main(check + ["--resumed", str(path)])

    assert resumed("good.jsonl") == 0
    assert resumed("drifted.jsonl", shift=0.05) == 1
    assert resumed("restarted.jsonl", start_step=0) == 1
    assert resumed("lr.jsonl", lrs={15: 2e-3}) == 1
    output = capsys.readouterr().out
    assert "resume check passed" in output and "did not load the checkpoint" in output
    assert "the scheduler did not resume" in output


def test_plot_summary_and_png(tmp_path, plot_losses, capsys):
    stock = {s: 5.0 - 0.01 * s for s in range(1, 31)}
    write_metrics(tmp_path / "stock.jsonl", stock)
    write_metrics(tmp_path / "comet.jsonl", {s: v + (0.02 if s == 7 else 0.0) for s, v in stock.items()})
    png = tmp_path / "curves.png"
    runs = [f"stock={tmp_path / 'stock.jsonl'}", f"comet={tmp_path / 'comet.jsonl'}"]
    assert plot_losses.main(["plot", "--out", str(png), "--json", str(tmp_path / "s.json")] + runs) == 0
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 2000
    output = capsys.readouterr().out
    assert "max |loss diff| 0.0200 at step 7" in output and "1.000x" in output
    assert plot_losses.main(["plot", "--max-diff-tol", "0.01"] + runs) == 1
    assert plot_losses.main(["plot", f"missing={tmp_path / 'none.jsonl'}"] + runs) == 2


def test_rounds_ratios_per_round(tmp_path, plot_losses, capsys):
    def run(name, tokens, memory):
        path = tmp_path / f"{name}.jsonl"
        write_metrics(path, {1: 3.0, 2: 2.9})
        with open(path, "a") as handle:  # the last train_end record wins
            handle.write(json.dumps({"event": "train_end", "steady_tokens_per_s": tokens, "peak_mem_mib": memory})
                         + "\n")
        return f"{name.replace('_', '/')}={path}"

    # The host drifts between rounds: comet is 1.2x and 1.5x of the stock run beside it, not of stock's mean.
    runs = [run("stock_1", 100.0, 50.0), run("comet_1", 120.0, 40.0), run("stock_2", 80.0, 50.0),
            run("comet_2", 120.0, 45.0)]
    json_path = tmp_path / "rounds.json"
    assert plot_losses.main(["rounds", "--json", str(json_path)] + runs) == 0
    summary = json.loads(json_path.read_text())
    comet = summary["arms"][1]
    assert summary["base"] == "stock" and comet["arm"] == "comet"
    assert comet["ratio"] == {"1": 1.2, "2": 1.5}
    assert abs(comet["ratio_geomean"] - (1.2 * 1.5) ** 0.5) < 1e-12
    assert comet["peak_mem_mib"] == 45.0 and comet["peak_mem_vs_base_mib"] == -5.0
    assert "1.342x (1.200-1.500)" in capsys.readouterr().out
    # A round without the baseline arm cannot be compared: said, and exit status 2.
    assert plot_losses.main(["rounds"] + runs[:3] + [run("comet_3", 90.0, 40.0)]) == 2
    assert "round 3 has no stock run" in capsys.readouterr().err


SHARED_RANKS = os.path.join(REPO, "scripts", "shared_gpu_ranks.sh")


def test_shared_gpu_ranks_environment():
    report = "import os; print(*(os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_PORT')))"
    done = subprocess.run(["bash", SHARED_RANKS, "3", "29599", sys.executable, "-c", report], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split("\n")[:-1]) == [f"{rank} 3 0 29599" for rank in range(3)], done.stdout


# Rank 0 starts a child that would run for ten minutes and writes the child's pid; the other ranks
# wait for that file, then rank 1 fails (or, with keep_going, every rank waits too).
SHARED_RANKS_CASE = """
import os, signal, subprocess, sys, time
pid_file, keep_going = sys.argv[1], sys.argv[2] == "1"
if os.environ["RANK"] == "0":
    if len(sys.argv) > 3:  # a rank that ignores TERM, and so does its child
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(pid_file + ".tmp", "w") as handle:
        handle.write(f"{os.getpid()} {child.pid}")
    os.rename(pid_file + ".tmp", pid_file)
    time.sleep(600)
while not os.path.exists(pid_file):
    time.sleep(0.05)
if os.environ["RANK"] == "1" and not keep_going:
    sys.exit(7)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _gone(pid)


def test_shared_gpu_ranks_failure_stops_the_others(tmp_path):
    # Rank 1 fails while rank 0 (and its child) would wait for it for ten minutes: the launcher must
    # stop both and exit with rank 1's status.
    pid_file = str(tmp_path / "child.pid")
    began = time.monotonic()
    done = subprocess.run(["bash", SHARED_RANKS, "3", "29598", sys.executable, "-c", SHARED_RANKS_CASE, pid_file, "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 7, (done.returncode, done.stderr)
    assert time.monotonic() - began < 60
    assert all(_wait_gone(int(pid), 10) for pid in open(pid_file).read().split()), "rank 0 outlived the launcher"


@pytest.mark.parametrize("ignore_term", [False, True], ids=["term", "kill-after-grace"])
def test_shared_gpu_ranks_stops_every_rank_on_term(tmp_path, ignore_term):
    pid_file = str(tmp_path / "child.pid")
    command = ["bash", SHARED_RANKS, "2", "29596", sys.executable, "-c", SHARED_RANKS_CASE, pid_file, "1"]
    launcher = subprocess.Popen(command + (["ignore-term"] if ignore_term else []), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=dict(os.environ, GRACE_S="1"))
    deadline = time.monotonic() + 60
    while not os.path.exists(pid_file) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.path.exists(pid_file), "rank 0 never started its child"
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=30) == 143
    assert all(_wait_gone(int(pid), 10) for pid in open(pid_file).read().split()), "rank 0 outlived the launcher"


def test_shared_gpu_ranks_rejects_bad_arguments():
    done = subprocess.run(["bash", SHARED_RANKS, "two", "29597", "true"], capture_output=True, text=True, timeout=20)
    assert done.returncode == 2 and "usage" in done.stderr


@pytest.mark.parametrize("shared", ["0", "1"])
def test_train_compare_checks_its_knobs(tmp_path, shared):
    # A bad knob stops the script with its own message, after the setup every mode runs (a failing
    # statement there would stop it earlier, silently, under set -e).
    env = dict(os.environ, TRAIN_COMPARE_CPU="1", TRAIN_COMPARE_SHARED_GPU=shared, AB_ROUNDS="0",
               OUT=str(tmp_path / "out"))
    done = subprocess.run(["bash", os.path.join(REPO, "scripts", "train_compare.sh")], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    assert "AB_ROUNDS must be a positive integer" in done.stderr
