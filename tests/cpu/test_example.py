"""examples/train_moe.py end to end: CPU ranks under torchrun, the deepspeed launcher and mpirun.

The runs have DS_COMET_TEST_WORLD_SIZE ranks (2 when unset); the example takes its expert-parallel
size and expert count from the world size.

Every run uses the same seed and model, and the example draws its data and the gate's noise from
(seed, rank, step), so the runs must agree with one another step by step: a resumed run with the
uninterrupted one, mpirun with torchrun, and the comet backend with stock DeepSpeed's; a tiny
Hugging Face Mixtral under AutoEP trains alike on AutoEP alone and on ds_comet. The runs'
metrics come back through DeepSpeed's csv_monitor. Runs are shared between tests through
module-scoped fixtures; the checkpoint tests damage copies of one saved run. The whole file takes
about three minutes on two cores (the first launch on a machine also JIT-builds DeepSpeed's shm
comm op, about a minute more).
"""

import contextlib
import csv
import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.support.dist_pool import cpu_world_size, free_port, remove_shm_buffers
from tests.support.launches import cpu_environment, run_launch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "examples", "train_moe.py")
PLOT_LOSSES = os.path.join(REPO, "scripts", "plot_losses.py")
CONFIGS = os.path.join(REPO, "configs")
TIMEOUT_S = 300
RANKS = cpu_world_size()
STEPS = 30
MICRO_BATCH, SEQ_LEN, TOP_K, LAYERS = 8, 64, 2, 2  # the example's defaults with configs/zero*.json
LOG_LINE = re.compile(r"^step (\d+) \| loss ([0-9.]+) \| aux ([0-9.]+) \| tokens/s (\d+)$", re.MULTILINE)


def config(name):
    return os.path.join(CONFIGS, f"{name}.json")


def read_monitor(directory):
    """{csv file name less .csv: [(step, value)]} of a csv_monitor directory; {} when it does not exist.

    Rows whose step is not a number are the header csv_monitor writes when a process first writes a tag.
    """
    series = {}
    if not os.path.isdir(directory):
        return series
    for name in sorted(os.listdir(directory)):
        if name.endswith(".csv"):
            with open(os.path.join(directory, name), newline="") as handle:
                series[name[:-4]] = [
                    (int(step), float(value)) for step, value in csv.reader(handle) if step.lstrip("-").isdigit()
                ]
    return series


class Run:
    """One finished launch: its exit status, combined output, csv_monitor series and wall time."""

    def __init__(self, cmd, returncode, output, monitor_dir, seconds):
        self.cmd, self.returncode, self.output, self.seconds = cmd, returncode, output, seconds
        self.monitor_dir = monitor_dir
        self.series = read_monitor(monitor_dir) if monitor_dir else {}

    def by_step(self, name):
        """{step: value} of one tag (its csv name); a step logged twice keeps its last value."""
        return dict(self.series.get(name, []))

    @property
    def losses(self):
        return self.by_step("Train_Steps_loss")

    def last(self, name):
        """The last value of a tag, None when it was never written."""
        rows = self.series.get(name)
        return rows[-1][1] if rows else None

    @property
    def logged(self):
        """[(step, loss, aux, tokens/s)] from the printed log lines."""
        return [(int(s), float(l), float(a), int(t)) for s, l, a, t in LOG_LINE.findall(self.output)]

    def value(self, label):
        match = re.search(rf"^{label} ([0-9.]+)", self.output, re.MULTILINE)
        return float(match.group(1)) if match else None

    def tail(self, chars=5000):
        return f"\n$ {' '.join(self.cmd)}\n--- output tail ---\n{self.output[-chars:]}"


def launch(cmd, port, monitor_dir=None, env_extra=None, expect_success=True) -> Run:
    """Runs the example's launch command (``launches.run_launch``; port is its MASTER_PORT).

    With expect_success, a non-zero exit status fails the test; else the caller checks it.
    """
    returncode, output, seconds = run_launch(cmd, port, TIMEOUT_S, env_extra)
    run = Run(cmd, returncode, output, monitor_dir, seconds)
    if expect_success:
        assert returncode == 0, f"exit status {returncode}{run.tail()}"
    return run


def example_args(ds_config, monitor_dir, steps=STEPS, *extra):
    """The example's arguments; ds_config is a name under configs/ or a path, monitor_dir None for the config's own."""
    path = ds_config if os.path.isabs(ds_config) else config(ds_config)
    monitor = ["--monitor-dir", str(monitor_dir)] if monitor_dir else []
    return [
        SCRIPT,
        "--deepspeed_config",
        path,
        "--steps",
        str(steps),
        "--log-interval",
        "1",
        "--eval-batches",
        "2",
        *monitor,
        *extra,
    ]


def torchrun(
    tmp_dir, name, ds_config, steps=STEPS, *extra, monitor_dir=None, expect_success=True, env_extra=None
) -> Run:
    """The example under torchrun; its metrics in monitor_dir (default: tmp_dir/name, through --monitor-dir)."""
    given = monitor_dir is not None
    monitor_dir = monitor_dir or os.path.join(tmp_dir, name)
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(RANKS),
        "--master_port",
        str(port),
    ] + example_args(ds_config, None if given else monitor_dir, steps, *extra)
    return launch(cmd, port, monitor_dir, env_extra=env_extra, expect_success=expect_success)


def assert_same_losses(run, reference, steps, tol, what):
    ours, theirs = run.losses, reference.losses
    missing = [s for s in steps if s not in ours or s not in theirs]
    assert not missing, f"{what}: no loss logged for steps {missing}{run.tail()}"
    worst = max(steps, key=lambda s: abs(ours[s] - theirs[s]))
    diff = abs(ours[worst] - theirs[worst])
    assert diff <= tol, (
        f"{what}: loss at step {worst} is {ours[worst]:.6f}, expected {theirs[worst]:.6f} "
        f"(|diff| {diff:.2e} > {tol:g}){run.tail()}"
    )


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("train_moe"))


@pytest.fixture(scope="module")
def comet_run(workdir):
    """The reference run: torchrun, RANKS ranks, ZeRO-2, comet backend, STEPS steps, metrics through --monitor-dir."""
    return torchrun(workdir, "comet_zero2", "zero2_comet")


def hjson_config(source, path, monitor_dir):
    """Writes configs/<source>.json to path as HJSON with comments, its csv_monitor writing to monitor_dir."""
    with open(config(source)) as handle:
        ds_config = json.load(handle)
    ds_config["csv_monitor"] = {
        "enabled": True,
        "output_path": os.path.dirname(monitor_dir),
        "job_name": os.path.basename(monitor_dir),
    }
    body = json.dumps(ds_config, indent=2)
    with open(path, "w") as handle:
        handle.write("// " + source + " with DeepSpeed's CSV monitor (HJSON: DeepSpeed reads comments)\n")
        handle.write(body.replace("{\n", "{\n  # metrics through DeepSpeed's monitor\n", 1) + "\n")
    return path


@pytest.fixture(scope="module")
def stock_run(workdir):
    """Stock DeepSpeed's backend, its config an HJSON file with comments that enables csv_monitor itself."""
    monitor_dir = os.path.join(workdir, "stock_monitor")
    path = hjson_config("zero2_deepspeed", os.path.join(workdir, "stock.hjson"), monitor_dir)
    return torchrun(workdir, "deepspeed_zero2", path, STEPS, "--step-shares", monitor_dir=monitor_dir)


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


def assert_expert_counts(run, steps_per_window=1, seq_len=SEQ_LEN):
    """Every log window's per-expert token counts: each layer's sum over its experts is every token the
    window routed (all ranks, top-k), and the layer's experts are all there."""
    tokens = RANKS * MICRO_BATCH * seq_len * TOP_K * steps_per_window
    experts = 4 * RANKS
    for layer in range(LAYERS):
        names = [f"Train_Steps_expert_tokens_layer{layer}_expert{e}" for e in range(experts)]
        missing = [name for name in names if name not in run.series]
        assert not missing, f"no per-expert counts {missing[:3]}... in {sorted(run.series)}"
        windows = sorted(run.by_step(names[0]))
        assert windows, run.tail()
        for step in windows:
            counts = [run.by_step(name)[step] for name in names]
            assert all(c >= 0 and c == int(c) for c in counts), counts
            assert sum(counts) == tokens, (
                f"layer {layer}, window ending at step {step}: the experts' counts "
                f"{counts} sum to {sum(counts)}, not the {tokens} tokens routed"
            )
        assert len(windows) == len(run.losses) // steps_per_window


def test_torchrun_zero2_comet_learns(comet_run):
    start, end = assert_learns(comet_run)
    # The printed log lines and the monitor's losses say the same thing.
    logged = comet_run.logged
    assert [s for s, *_ in logged] == list(range(1, STEPS + 1)), comet_run.tail()
    for step, loss, aux, tokens_per_s in logged:
        assert abs(loss - comet_run.losses[step]) < 1e-3
        assert abs(aux - comet_run.by_step("Train_Steps_aux_loss")[step]) < 1e-3
        assert 0 < aux < 10 and tokens_per_s > 0
        assert abs(tokens_per_s - comet_run.by_step("Train_Steps_tokens_per_s")[step]) <= 1
    final, evaluated = comet_run.value("final loss"), comet_run.value("eval loss")
    assert final is not None and abs(final - comet_run.losses[STEPS]) < 1e-3, comet_run.tail()
    assert evaluated is not None and evaluated < 4.0, f"eval loss {evaluated}{comet_run.tail()}"
    assert "backend comet" in comet_run.output, comet_run.tail()
    assert f"csv_monitor writes to {comet_run.monitor_dir}" in comet_run.output, comet_run.tail()
    # Written through DeepSpeed's monitor: the engine's own events land next to the example's.
    assert "Train_Samples_lr" in comet_run.series, sorted(comet_run.series)
    assert_expert_counts(comet_run)
    # The run's facts at its start step, its summary at its last.
    run_info = {
        name: comet_run.series[f"Run_{name}"] for name in ("start_step", "world_size", "zero_stage", "tokens_per_step")
    }
    assert run_info == dict(
        start_step=[(0, 0)],
        world_size=[(0, RANKS)],
        zero_stage=[(0, 2)],
        tokens_per_step=[(0, RANKS * MICRO_BATCH * SEQ_LEN)],
    ), run_info
    lrs = comet_run.by_step("Train_Steps_lr")
    assert lrs[1] < lrs[5] == lrs[STEPS], f"learning rates {lrs}: the 5-step warm-up is not what was used"
    summary = {name[len("Summary_") :]: rows for name, rows in comet_run.series.items() if name.startswith("Summary_")}
    assert all(rows[-1][0] == STEPS for rows in summary.values()), summary
    assert abs(summary["final_loss"][-1][1] - comet_run.losses[STEPS]) < 1e-9, summary
    assert abs(summary["eval_loss"][-1][1] - evaluated) < 1e-3, summary
    assert summary["timed_steps"][-1][1] == STEPS - 5 and summary["steady_tokens_per_s"][-1][1] > 0, summary
    assert "peak_memory_mib" not in summary, "peak accelerator memory reported on CPU"
    throughput = comet_run.value("throughput")
    assert throughput is not None and abs(throughput - summary["steady_tokens_per_s"][-1][1]) < 1, comet_run.tail()
    print(f"\ntorchrun zero2_comet: loss {start:.3f} -> {end:.3f}, eval {evaluated:.3f}, {comet_run.seconds:.0f} s")


def test_deepspeed_launcher_zero1_comet(workdir, comet_run):
    steps = 10
    monitor_dir = os.path.join(workdir, "launcher_zero1")
    deepspeed_cli = shutil.which("deepspeed")
    if deepspeed_cli is None:
        pytest.skip("the deepspeed launcher is not on PATH")
    port = free_port()
    cmd = [deepspeed_cli, "--num_gpus", str(RANKS), "--master_port", str(port)] + example_args(
        "zero1_comet", monitor_dir, steps, "--log-level", "info"
    )
    run = launch(cmd, port, monitor_dir)
    assert sorted(run.losses) == list(range(1, steps + 1)), run.tail()
    assert [s for s, *_ in run.logged] == list(range(1, steps + 1)), run.tail()
    assert f"world size {RANKS} " in run.output, run.tail()
    # --log-level info reaches DeepSpeed's logger in the ranks (set_log_level_from_string): DeepSpeed's
    # "Creating MoE layer" line is info (the launcher's own info lines carry no rank).
    assert re.search(r"\[INFO\] .*\[Rank 0\] Creating MoE layer", run.output), run.tail()
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
    monitor_dir = os.path.join(workdir, "mpirun")
    cmd = mpirun_command() + [sys.executable] + example_args("zero2_comet", monitor_dir, steps)
    # The example takes the ranks from the MPI launcher's variables, MASTER_PORT from the environment
    # and MASTER_ADDR 127.0.0.1 (none given).
    port = free_port()
    run = launch(cmd, port, monitor_dir, env_extra={"MASTER_PORT": str(port)})
    assert f"world size {RANKS} " in run.output, run.tail()
    assert f"ranks from the MPI launcher's environment (MASTER_ADDR 127.0.0.1, MASTER_PORT {port})" in run.output, (
        run.tail()
    )
    assert sorted(run.losses) == list(range(1, steps + 1)), run.tail()
    assert_same_losses(run, comet_run, range(1, steps + 1), 1e-3, "mpirun against torchrun")
    print(f"\nmpirun zero2_comet: {run.losses[1]:.3f} -> {run.losses[steps]:.3f}, {run.seconds:.0f} s")


# --------------------------------------------------------------------------------------------
# Checkpoints: manifests, `latest`, resume, and what a resume refuses
# --------------------------------------------------------------------------------------------

SAVE_AT = 15


@pytest.fixture(scope="module")
def first_half(workdir):
    """A run of SAVE_AT steps saving every 5, and a copy of its checkpoints as they were then."""
    save_dir = os.path.join(workdir, "checkpoints")
    run = torchrun(workdir, "resume", "zero2_comet", SAVE_AT, "--save-dir", save_dir, "--save-interval", "5")
    pristine = os.path.join(workdir, "checkpoints_after_first_half")
    shutil.copytree(save_dir, pristine, symlinks=True)
    return run, save_dir, pristine


def checkpoint_copy(first_half, workdir, name):
    """A fresh copy of the first half's checkpoints, for a test to damage."""
    copy = os.path.join(workdir, name)
    shutil.copytree(first_half[2], copy, symlinks=True)
    return copy


def sha256_file(path):
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


def manifest_of(checkpoint_dir):
    with open(os.path.join(checkpoint_dir, "SHA256SUMS")) as handle:
        return dict(reversed(line.split("  ", 1)) for line in handle.read().splitlines())


def test_save_and_resume(workdir, comet_run, first_half):
    first, save_dir, _ = first_half
    assert {"latest", "step5", "step10", "step15"} <= set(os.listdir(save_dir)), os.listdir(save_dir)
    with open(os.path.join(save_dir, "latest")) as handle:
        assert handle.read().strip() == f"step{SAVE_AT}"
    # Every save has a manifest naming every one of its files with its sha256 (sha256sum's format).
    for tag in ("step5", "step10", "step15"):
        checkpoint_dir = os.path.join(save_dir, tag)
        manifest = manifest_of(checkpoint_dir)
        files = sorted(name for name in os.listdir(checkpoint_dir) if name != "SHA256SUMS")
        assert sorted(manifest) == files and any("optim_states" in name for name in files), (tag, manifest)
        assert all(sha256_file(os.path.join(checkpoint_dir, name)) == digest for name, digest in manifest.items())
    assert_same_losses(first, comet_run, range(1, SAVE_AT + 1), 1e-3, "first half")

    second = torchrun(workdir, "resume", "zero2_comet", STEPS, "--save-dir", save_dir, "--resume")
    assert f"at step {SAVE_AT}" in second.output, second.tail()
    logged_steps = [s for s, *_ in second.logged]
    assert logged_steps and logged_steps[0] == SAVE_AT + 1 and logged_steps[-1] == STEPS, second.tail()
    # The monitor's files were appended to: one history, steps 1..STEPS, from the two launches.
    assert sorted(second.losses) == list(range(1, STEPS + 1)), second.tail()
    assert [v for _, v in second.series["Run_start_step"]] == [0, SAVE_AT], second.series["Run_start_step"]
    # Model, optimizer (Adam moments), scheduler, data and gate noise all resume: the second half
    # follows the uninterrupted run.
    assert_same_losses(second, comet_run, range(SAVE_AT + 1, STEPS + 1), 1e-3, "resumed run")
    assert os.path.isfile(os.path.join(save_dir, f"step{STEPS}", "SHA256SUMS"))
    # The comparison tool reads the same from the two monitor directories.
    check = subprocess.run(
        [
            sys.executable,
            PLOT_LOSSES,
            "resume-check",
            "--full",
            comet_run.monitor_dir,
            "--resumed",
            second.monitor_dir,
            "--from-step",
            str(SAVE_AT),
            "--first-tol",
            "1e-3",
            "--tol",
            "1e-3",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0 and "resume check passed" in check.stdout, check.stdout + check.stderr
    print(
        f"\nresume at {SAVE_AT}: loss {second.losses[SAVE_AT + 1]:.4f} at step {SAVE_AT + 1} "
        f"(uninterrupted {comet_run.losses[SAVE_AT + 1]:.4f}), {first.seconds:.0f} s + {second.seconds:.0f} s"
    )


def overwrite_middle(path, data):
    """Writes data into the middle of a file, keeping its size (a damaged sector, not a short file)."""
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:
        handle.seek(size // 2)
        original = handle.read(len(data))
        assert original != data
        handle.seek(size // 2)
        handle.write(data)


def test_resume_refuses_a_damaged_checkpoint(workdir, first_half):
    save_dir = checkpoint_copy(first_half, workdir, "damaged")
    damaged = [
        f"layer_0_expert_{4 * RANKS - 1}_mp_rank_00_model_states.pt",
        f"zero_pp_rank_{RANKS - 1}_mp_rank_00_optim_states.pt",
    ]
    for name in damaged:
        overwrite_middle(os.path.join(save_dir, "step15", name), os.urandom(64))
    run = torchrun(
        workdir, "damaged_resume", "zero2_comet", STEPS, "--save-dir", save_dir, "--resume", expect_success=False
    )
    assert run.returncode != 0, f"resumed from a damaged checkpoint{run.tail()}"
    assert "resumed from" not in run.output and not run.logged, run.tail()
    assert "checkpoint step15 in " + save_dir + " is damaged" in run.output, run.tail()
    for name in damaged:
        assert f"step15/{name}: damaged" in run.output, f"{name} not named{run.tail()}"
    assert "the newest intact checkpoint is step10: resume from it with --resume-tag step10" in run.output, run.tail()
    print(f"\ndamaged checkpoint refused, {run.seconds:.0f} s")


def test_resume_refuses_a_checkpoint_of_another_shape(workdir, first_half):
    save_dir = checkpoint_copy(first_half, workdir, "other_shape")
    experts = 2 * RANKS  # the first half ran the default, 4 a rank
    run = torchrun(
        workdir,
        "other_shape_resume",
        "zero2_comet",
        STEPS,
        "--save-dir",
        save_dir,
        "--resume",
        "--experts",
        str(experts),
        expect_success=False,
    )
    assert run.returncode != 0 and "resumed from" not in run.output, run.tail()
    assert (
        f"checkpoint step{SAVE_AT} in {save_dir} was saved by a run of another shape: --experts {4 * RANKS} "
        f"(this run: {experts}); resume with the flags"
    ) in run.output, run.tail()


def test_non_finite_loss_after_resume_stops_the_run(workdir, first_half):
    # A checkpoint that is whole (its manifest matches) but whose fp32 master weights are NaN: the
    # resumed run trains one step on the loaded weights, then on NaNs.
    import torch

    save_dir = checkpoint_copy(first_half, workdir, "non_finite")
    checkpoint_dir = os.path.join(save_dir, "step10")
    name = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    path = os.path.join(checkpoint_dir, name)
    state = torch.load(path, weights_only=False)
    for partition in state["optimizer_state_dict"]["single_partition_of_fp32_groups"]:
        partition.data.fill_(float("nan"))
    torch.save(state, path)
    manifest = manifest_of(checkpoint_dir)
    manifest[name] = sha256_file(path)
    with open(os.path.join(checkpoint_dir, "SHA256SUMS"), "w") as handle:
        handle.write("".join(f"{digest}  {file}\n" for file, digest in sorted(manifest.items())))
    run = torchrun(
        workdir,
        "non_finite_resume",
        "zero2_comet",
        STEPS,
        "--save-dir",
        save_dir,
        "--resume-tag",
        "step10",
        "--save-interval",
        "1",
        expect_success=False,
    )
    assert run.returncode != 0, f"trained on after non-finite losses{run.tail()}"
    assert "resumed from" in run.output and "at step 10" in run.output, run.tail()
    match = re.search(
        r"error: step (\d+): the loss is not finite .* after resuming from checkpoint step10 in " + re.escape(save_dir),
        run.output,
    )
    assert match and 10 < int(match.group(1)) <= 15, run.tail()
    stopped = int(match.group(1))
    # No checkpoint of the non-finite state: the step that went wrong saved nothing.
    assert not os.path.exists(os.path.join(save_dir, f"step{stopped}")), os.listdir(save_dir)
    print(f"\nnon-finite loss at step {stopped} stopped the run, {run.seconds:.0f} s")


def single_process(*args):
    """The example as one process without a launcher (it must stop before it starts a process group)."""
    port = free_port()
    return launch(
        [sys.executable, SCRIPT, "--deepspeed_config", config("zero2_comet"), *args], port, expect_success=False
    )


def test_resume_without_a_checkpoint_is_an_error(workdir, first_half, example):
    empty = os.path.join(workdir, "no_checkpoints")
    os.makedirs(empty, exist_ok=True)
    run = single_process("--save-dir", empty, "--resume")
    assert run.returncode == 1, f"exit status {run.returncode}{run.tail()}"
    assert f"error: --resume: no checkpoint in {empty}: it has no 'latest' file" in run.output, run.tail()
    # The same check, in this process: a tag that is not there is named with the ones that are.
    with pytest.raises(
        SystemExit, match=re.escape(f"no checkpoint step7 in {first_half[2]} (there: step10, step15, step5)")
    ):
        example.main(
            ["--deepspeed_config", config("zero2_comet"), "--save-dir", first_half[2], "--resume-tag", "step7"]
        )


# Loaded into every process of a run (sitecustomize): the last rank's optimizer file of step10
# meets a full disk, as torch.save reports one.
FULL_DISK_AT_STEP10 = """
import errno, os
import torch
_save = torch.save
def save(obj, f, *args, **kwargs):
    if isinstance(f, (str, os.PathLike)) and os.fspath(f).endswith(os.path.join("step10.saving", {name!r})):
        raise OSError(errno.ENOSPC, "No space left on device", os.fspath(f))
    return _save(obj, f, *args, **kwargs)
torch.save = save
"""


def test_a_failed_save_keeps_latest_and_the_earlier_checkpoint_of_its_tag(workdir, first_half):
    # The save directory holds the first half's intact step5, step10 and step15. A new run saves
    # step5 over the old one, then step10, which it writes (as every save) under step10.saving: there
    # the last rank's optimizer file meets a full disk, so that rank fails while the others have
    # written their files. `latest` must still name step5, and the earlier step10 must be whole.
    save_dir = checkpoint_copy(first_half, workdir, "disk_full")
    earlier_step10 = manifest_of(os.path.join(save_dir, "step10"))
    hook = os.path.join(workdir, "full_disk_hook")
    os.makedirs(hook)
    with open(os.path.join(hook, "sitecustomize.py"), "w") as handle:
        handle.write(FULL_DISK_AT_STEP10.format(name=f"zero_pp_rank_{RANKS - 1}_mp_rank_00_optim_states.pt"))
    run = torchrun(
        workdir,
        "disk_full",
        "zero2_comet",
        12,
        "--save-dir",
        save_dir,
        "--save-interval",
        "5",
        expect_success=False,
        env_extra={"PYTHONPATH": os.pathsep.join([hook, REPO])},
    )
    assert run.returncode != 0, run.tail()
    assert "saved checkpoint " + os.path.join(save_dir, "step5") in run.output, run.tail()
    assert re.search(
        r"DiskFullError: \[Errno 28\] saving checkpoint step10: the disk is full: [0-9.]+ \w+ free "
        r"under " + re.escape(save_dir),
        run.output,
    ), run.tail()
    with open(os.path.join(save_dir, "latest")) as handle:
        assert handle.read() == "step5", "latest names a checkpoint that a rank did not finish writing"
    for tag in ("step5", "step10"):  # step5 replaced whole, step10 the earlier run's, untouched
        checkpoint_dir = os.path.join(save_dir, tag)
        manifest = manifest_of(checkpoint_dir)
        assert all(sha256_file(os.path.join(checkpoint_dir, name)) == digest for name, digest in manifest.items())
    assert manifest_of(os.path.join(save_dir, "step10")) == earlier_step10
    assert not os.path.exists(os.path.join(save_dir, "step5.replaced"))
    # The files the other ranks wrote are there: it was the failing rank that kept `latest` back.
    assert os.path.getsize(os.path.join(save_dir, "step10.saving", "zero_pp_rank_0_mp_rank_00_optim_states.pt")) > 0


# --------------------------------------------------------------------------------------------
# A rank that stops, a launcher that dies, a save directory that cannot be written
# --------------------------------------------------------------------------------------------

# Loaded into every process of a run (sitecustomize): rank 1 stops after the backward of step 3,
# before that step's update, in which its peers wait for it in DeepSpeed's ZeRO collectives.
STOP_RANK1_BEFORE_STEP3_UPDATE = """
import os, time
if os.environ.get("RANK") == "1":
    from deepspeed.runtime.engine import DeepSpeedEngine
    _step = DeepSpeedEngine.step
    def step(self, *args, **kwargs):
        if self.global_steps == 2:
            time.sleep(600)
        return _step(self, *args, **kwargs)
    DeepSpeedEngine.step = step
"""
WAIT_TIMEOUT_S = 2  # the run's "moe": {"wait_timeout_s"}: the process groups' timeout is 2 x 2 + 10 s


def test_a_rank_stopped_inside_a_step_ends_its_peers_by_name(workdir):
    """Rank 1 stops between its MoE backward and the step's update; its peers wait for it in
    DeepSpeed's own collectives. The example's process groups take their timeout from the ds_config's
    "wait_timeout_s" (2 x 2 + 10 s, not DeepSpeed's 30 minutes), and the step's error names rank 1."""
    hook = os.path.join(workdir, "stop_rank1_hook")
    os.makedirs(hook)
    with open(os.path.join(hook, "sitecustomize.py"), "w") as handle:
        handle.write(STOP_RANK1_BEFORE_STEP3_UPDATE)
    with open(config("zero2_comet")) as handle:
        ds_config = json.load(handle)
    ds_config["moe"]["wait_timeout_s"] = WAIT_TIMEOUT_S
    path = os.path.join(workdir, "zero2_comet_short_wait.json")
    with open(path, "w") as handle:
        json.dump(ds_config, handle)
    run = torchrun(
        workdir,
        "stopped_rank",
        path,
        6,
        "--corpus-mb",
        "0.5",
        expect_success=False,
        env_extra={"PYTHONPATH": os.pathsep.join([hook, REPO])},
    )
    assert run.returncode != 0, run.tail()
    match = re.search(
        r"CometWaitTimeout: ds_comet: training step 3: rank 0 of the job \(global ranks [0-9, -]+\) waited ([0-9.]+) s "
        r"for a collective of DeepSpeed's or torch's inside it \(bounded by the process groups' timeout, 14 s\); "
        r"global rank\(s\) 1 of the group did not report a wait of their own within 2 s more",
        run.output,
    )
    assert match and float(match.group(1)) <= 15, run.tail()
    assert "step 2 | loss" in run.output and "step 3 | loss" not in run.output, run.tail()
    print(f"\nrank 1 stopped in step 3: named after {match.group(1)} s, the run ended in {run.seconds:.0f} s")


def _session_processes(session: int) -> list[int]:
    """The live processes of ``session`` (from /proc), zombies left out."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields[0] != "Z" and int(fields[3]) == session:  # state, then ppid, pgrp, session
            found.append(int(entry))
    return found


def test_ranks_exit_when_the_deepspeed_command_is_killed():
    """The deepspeed command on one node forwards no signal to DeepSpeed's launch.py, which started
    the ranks: ended by SIGTERM (or SIGINT, which ends it the same way), it would leave them
    training. Each rank watches the command and exits."""
    deepspeed_cli = shutil.which("deepspeed") or os.path.join(os.path.dirname(sys.executable), "deepspeed")
    if not os.path.exists(deepspeed_cli):
        pytest.skip("the deepspeed launcher is not installed")
    port = free_port()
    cmd = [deepspeed_cli, "--num_gpus", str(RANKS), "--master_port", str(port)] + example_args(
        "zero2_comet", None, 100000, "--corpus-mb", "0.5"
    )
    runner = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=cpu_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
    )
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(runner.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not any(line.startswith("step 1 | loss") for line in list(lines)) and time.monotonic() < deadline:
            assert runner.poll() is None, "".join(lines)
            time.sleep(0.2)
        assert time.monotonic() < deadline, "the run never trained" + "".join(lines)[-3000:]
        runner.send_signal(signal.SIGTERM)
        runner.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _session_processes(runner.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _session_processes(runner.pid)
        reader.join(timeout=10)
        output = "".join(lines)
        assert not left, f"processes {left} outlived the deepspeed command{output[-3000:]}"
        # The first rank to see it exits; launch.py, seeing a rank fail, then ends the others.
        assert re.search(
            rf"ds_comet: rank \d+: the deepspeed command above deepspeed.launcher.launch \(pid {runner.pid}\) "
            r"is gone; this rank exits rather than train on without it",
            output,
        ), output[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(runner.pid, signal.SIGKILL)
        for pid in _session_processes(runner.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        remove_shm_buffers(port)


def test_a_save_dir_that_cannot_be_written_is_refused_before_training(tmp_path, example):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    save_dir = str(blocker / "checkpoints")
    with pytest.raises(
        SystemExit, match=re.escape(f"error: --save-dir: checkpoints cannot be written to {save_dir}: ")
    ):
        example.main(["--deepspeed_config", config("zero2_comet"), "--save-dir", save_dir])
    # A run that never saves (--no-final-save, no save steps) only reads it: nothing to refuse there.
    args = example.parse_args(["--deepspeed_config", config("zero2_comet"), "--save-dir", save_dir, "--no-final-save"])
    assert example.check_save_dir(args) is None


def assert_step_shares(run, timed_steps):
    """--step-shares: every part of the timed steps was seen, and the printed line and the monitor's
    summary say the same."""
    line = re.search(
        r"step shares over (\d+) steps \([\d.]+ ms/step\): MoE layers ([\d.]+) ms \([\d.]+%: "
        r"forward ([\d.]+), backward ([\d.]+)\), optimizer step ([\d.]+) ms",
        run.output,
    )
    assert line and int(line.group(1)) == timed_steps, run.tail()
    summary = {name[len("Summary_") :]: rows[-1][1] for name, rows in run.series.items() if name.startswith("Summary_")}
    parts = ("moe_forward", "moe_backward", "optimizer", "rest")
    assert all(summary[f"{part}_ms"] > 0 for part in parts), summary  # the hooks saw each part
    printed = [float(line.group(i)) for i in (3, 4, 5)]
    monitored = [summary["moe_forward_ms"], summary["moe_backward_ms"], summary["optimizer_ms"]]
    assert all(abs(p - m) <= 0.005 + 1e-9 for p, m in zip(printed, monitored)), (printed, monitored)


def test_stock_backend_zero2(stock_run):
    start, end = assert_learns(stock_run)
    assert "backend deepspeed" in stock_run.output, stock_run.tail()
    assert stock_run.value("eval loss") is not None, stock_run.tail()
    assert f"csv_monitor writes to {stock_run.monitor_dir}" in stock_run.output, stock_run.tail()
    assert_expert_counts(stock_run)
    assert_step_shares(stock_run, STEPS - 5)
    print(f"\ntorchrun zero2_deepspeed (HJSON config): loss {start:.3f} -> {end:.3f}, {stock_run.seconds:.0f} s")


def test_comet_backend_matches_stock(comet_run, stock_run, tmp_path):
    # The comet layer computes what stock DeepSpeed's does (same gate, same experts, fp32), so
    # with the same seeds the two backends train along the same loss curve, and route alike.
    assert_same_losses(comet_run, stock_run, range(1, STEPS + 1), 1e-3, "comet backend against stock DeepSpeed")
    counts = [name for name in comet_run.series if name.startswith("Train_Steps_expert_tokens_")]
    assert all(comet_run.by_step(name) == stock_run.by_step(name) for name in counts)
    # The comparison tool reads both monitor directories.
    summary_path = tmp_path / "summary.json"
    done = subprocess.run(
        [
            sys.executable,
            PLOT_LOSSES,
            "plot",
            "--json",
            str(summary_path),
            "--max-diff-tol",
            "1e-3",
            f"stock={stock_run.monitor_dir}",
            f"comet={comet_run.monitor_dir}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(summary_path.read_text())["runs"]
    assert [row["steps"] for row in rows] == [STEPS, STEPS], rows
    assert abs(rows[1]["final_loss"] - comet_run.losses[STEPS]) < 1e-9 and rows[1]["zero_stage"] == 2, rows
    assert rows[0]["busiest_expert_share"] >= 1.0, rows


# --------------------------------------------------------------------------------------------
# A Hugging Face model under DeepSpeed AutoEP: AutoEP alone against AutoEP on ds_comet
# --------------------------------------------------------------------------------------------

HF_STEPS, HF_SEQ_LEN = 8, 32
HF_MIXTRAL = (
    "--hf-model",
    "mixtral",
    "--hidden",
    "64",
    "--ffn",
    "128",
    "--layers",
    str(LAYERS),
    "--heads",
    "4",
    "--seq-len",
    str(HF_SEQ_LEN),
)


def test_hf_mixtral_autoep_comet_matches_autoep(workdir):
    # The same configs as the byte-level runs: the example adds AutoEP's section for --hf-model, and
    # "moe" picks the backend. In fp32 on CPU the comet layers run the reference pipeline on AutoEP's
    # own router and experts, so the two runs route alike and train along one loss curve, to rounding.
    autoep = torchrun(workdir, "hf_autoep", "zero2_deepspeed", HF_STEPS, *HF_MIXTRAL)
    save_dir = os.path.join(workdir, "hf_checkpoints")
    comet = torchrun(
        workdir,
        "hf_autoep_comet",
        "zero2_comet",
        HF_STEPS,
        *HF_MIXTRAL,
        "--log-level",
        "info",
        "--save-dir",
        save_dir,
        "--save-at",
        "4",
        "--no-final-save",
        "--step-shares",
    )
    assert f"model mixtral | world size {RANKS} " in autoep.output, autoep.tail()
    assert f"moe layers {LAYERS} x AutoEPMoELayer |" in autoep.output, autoep.tail()
    # ds_comet.initialize converted AutoEP's layers: its own log line, and the layers' class.
    assert f"ds_comet: {LAYERS} MoE layer(s) run the comet backend" in comet.output, comet.tail()
    assert f"moe layers {LAYERS} x CometAutoEPMoELayer |" in comet.output, comet.tail()

    steps = list(range(1, HF_STEPS + 1))
    for run in (autoep, comet):
        assert sorted(run.losses) == steps, run.tail()
        assert run.losses[HF_STEPS] < run.losses[1] - 0.5, f"the model does not learn{run.tail()}"
        # Mixtral's default config adds no router loss.
        assert set(run.by_step("Train_Steps_aux_loss").values()) == {0.0}, run.tail()
        assert_expert_counts(run, seq_len=HF_SEQ_LEN)
    worst = max(steps, key=lambda s: abs(comet.losses[s] - autoep.losses[s]) / autoep.losses[s])
    relative = abs(comet.losses[worst] - autoep.losses[worst]) / autoep.losses[worst]
    assert relative <= 1e-4, (
        f"step {worst}: loss {comet.losses[worst]:.7f} under comet, {autoep.losses[worst]:.7f} "
        f"under AutoEP (relative difference {relative:.1e}){comet.tail()}"
    )
    counts = [name for name in autoep.series if name.startswith("Train_Steps_expert_tokens_")]
    assert all(comet.by_step(name) == autoep.by_step(name) for name in counts)
    assert_step_shares(comet, HF_STEPS - 5)  # AutoEP's layer class, as ds_comet converts it

    # AutoEP's checkpoint, saved through ds_comet.checkpoints: each expert in a file of its own.
    manifest = manifest_of(os.path.join(save_dir, "step4"))
    expert_file = re.compile(r"layer_\d+_expert_\d+_mp_rank_00_model_states\.pt")
    expert_files = [name for name in manifest if expert_file.fullmatch(name)]
    assert len(expert_files) == LAYERS * 4 * RANKS and any("optim_states" in name for name in manifest), manifest
    with open(os.path.join(save_dir, "latest")) as handle:
        assert handle.read() == "step4"
    print(
        f"\nMixtral under AutoEP: loss {autoep.losses[1]:.4f} -> {autoep.losses[HF_STEPS]:.4f}, comet's largest "
        f"relative difference {relative:.1e} at step {worst}; {autoep.seconds:.0f} s + {comet.seconds:.0f} s"
    )


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
    # The example imports its models from examples/moe_lm.py, which a script run finds beside it
    # (Python puts the script's directory first on sys.path); loaded here, it is put there too.
    sys.path.insert(0, os.path.dirname(SCRIPT))
    try:
        yield load_module("train_moe_example", SCRIPT)
    finally:
        sys.path.remove(os.path.dirname(SCRIPT))


@pytest.fixture(scope="module")
def plot_losses():
    return load_module("plot_losses", os.path.join(REPO, "scripts", "plot_losses.py"))


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
            ds_config = ds_comet.read_ds_config(path)
            moe = ds_comet.moe_config_from(ds_config)
            assert moe.backend == backend and ds_config["zero_optimization"]["stage"] == stage, path
            assert ds_config["bf16"]["enabled"] is True, path
            if backend == "deepspeed":  # no comet-only key, which stock would warn that it ignores
                assert ds_config["moe"] == {"backend": "deepspeed"}, path
                continue
            # The fused workspace holds one layer call of the preset: micro batch x window.
            assert moe.max_tokens_per_rank == ds_config["train_micro_batch_size_per_gpu"] * args.seq_len == 8192, path
    # The FP8 arm differs from the bf16 comet config in its recipe alone, so their losses compare the recipe.
    fp8_config = ds_comet.read_ds_config(config("gpu_zero2_comet_fp8"))
    assert ds_comet.moe_config_from(fp8_config).fp8.enabled
    fp8_config["moe"].pop("fp8")
    assert fp8_config == ds_comet.read_ds_config(config("gpu_zero2_comet"))


@pytest.mark.parametrize(
    "flag,value,words",
    [
        ("--log-interval", "0", "must be a positive integer"),
        ("--heads", "0", "must be a positive integer"),
        ("--moe-every", "0", "must be a positive integer"),
        ("--ep-size", "0", "must be a positive integer"),
        ("--warmup", "-1", "must be 0 or more"),
        ("--corpus-mb", "0", "must be a positive number"),
    ],
)
def test_flags_out_of_range_are_refused_by_name(example, capsys, flag, value, words):
    with pytest.raises(SystemExit):
        example.parse_args(["--deepspeed_config", "x.json", flag, value])
    assert f"argument {flag}: {words}" in capsys.readouterr().err


def test_hf_models_from_the_options(example):
    pytest.importorskip("transformers")
    args = example.parse_args(
        [
            "--hf-model",
            "qwen3_moe",
            "--deepspeed_config",
            "x.json",
            "--hidden",
            "96",
            "--ffn",
            "80",
            "--heads",
            "6",
            "--layers",
            "3",
            "--k",
            "3",
            "--seq-len",
            "16",
        ]
    )
    qwen = example.hf_moe_model(args, num_experts=8).config
    assert (
        qwen.vocab_size,
        qwen.hidden_size,
        qwen.moe_intermediate_size,
        qwen.num_attention_heads,
        qwen.head_dim,
        qwen.num_hidden_layers,
        qwen.num_experts,
        qwen.num_experts_per_tok,
    ) == (256, 96, 80, 6, 16, 3, 8, 3)
    assert qwen.norm_topk_prob and not qwen.output_router_logits
    args = example.parse_args(["--hf-model", "mixtral", "--deepspeed_config", "x.json"])
    mixtral = example.hf_moe_model(args, num_experts=4).config
    assert (
        mixtral.vocab_size,
        mixtral.hidden_size,
        mixtral.intermediate_size,
        mixtral.num_local_experts,
        mixtral.num_experts_per_tok,
    ) == (256, 64, 128, 4, 2)
    # AutoEP's section is added for the model's preset, and a config's own section is kept.
    config = {"moe": {"backend": "comet"}}
    assert example.add_expert_parallel_section(config, "mixtral", 2, on_cpu=True) == {
        "enabled": True,
        "autoep_size": 2,
        "preset_model": "mixtral",
        "use_grouped_mm": False,
    }
    own = {"expert_parallel": {"enabled": True, "autoep_size": 1, "preset_model": "mixtral"}}
    assert example.add_expert_parallel_section(own, "mixtral", 2, on_cpu=False) == {
        "enabled": True,
        "autoep_size": 1,
        "preset_model": "mixtral",
    }
    with pytest.raises(SystemExit):
        example.parse_args(["--hf-model", "mixtral", "--gated", "--deepspeed_config", "x.json"])


def test_training_config(example, tmp_path):
    # Read through ds_comet.read_ds_config (tests/cpu/test_config.py); a config it cannot read stops
    # the example with the reader's message.
    path = tmp_path / "ds_config.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 4}')
    assert example.training_config(str(path)) == {"train_micro_batch_size_per_gpu": 4}
    twice = tmp_path / "twice.json"
    twice.write_text('{"zero_optimization": {"stage": 1, "stage": 2}}')
    with pytest.raises(SystemExit, match=r"--deepspeed_config: invalid ds_config file .*twice\.json: Duplicate keys"):
        example.training_config(str(twice))
    with pytest.raises(SystemExit, match="neither an existing file nor a base64-encoded JSON config"):
        example.training_config(str(tmp_path / "absent.json"))
    # --monitor-dir turns csv_monitor on with its files directly in that directory.
    loaded = example.training_config(str(path), str(tmp_path / "metrics" / "run1"))
    assert loaded["csv_monitor"] == {"enabled": True, "output_path": str(tmp_path / "metrics"), "job_name": "run1"}
    assert "csv_monitor" not in example.training_config(str(path))


def write_monitor(directory, losses, lrs=None, start_step=0, summary=None, expert_tokens=None):
    """Writes a run's metrics as the example's csv_monitor does, appending (with a header for each tag,
    as a new process writes) when the directory exists: a resumed run's second launch."""
    os.makedirs(directory, exist_ok=True)

    def write(tag, rows):
        name = tag.replace("/", "_") + ".csv"
        with open(os.path.join(directory, name), "a", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["step", tag.split("/")[-1]])
            writer.writerows(rows)

    last = max(losses)
    write("Run/start_step", [(start_step, start_step)])
    write("Run/zero_stage", [(start_step, 2)])
    write("Train/Steps/loss", sorted(losses.items()))
    write("Train/Steps/lr", [(step, (lrs or {}).get(step, 1e-3)) for step in sorted(losses)])
    for (layer, expert), count in (expert_tokens or {}).items():
        write(f"Train/Steps/expert_tokens/layer{layer}_expert{expert}", [(last, count)])
    summary = dict(dict(steady_tokens_per_s=1000.0, peak_memory_mib=10.0, final_loss=losses[last]), **(summary or {}))
    for name, value in summary.items():
        write(f"Summary/{name}", [(last, value)])
    return str(directory)


def test_resume_check_catches_a_bad_resume(tmp_path, plot_losses, capsys):
    full = {s: 5.0 - 0.05 * s for s in range(1, 21)}
    write_monitor(tmp_path / "full", full)
    check = ["resume-check", "--full", str(tmp_path / "full"), "--from-step", "10"]

    def resumed(name, **kwargs):
        path = tmp_path / name
        write_monitor(path, {s: full[s] for s in range(1, 11)})  # the first launch; the resume appends
        losses = {s: full[s] + kwargs.get("shift", 0.0) for s in range(11, 21)}
        write_monitor(path, losses, kwargs.get("lrs"), kwargs.get("start_step", 10))
        return plot_losses.main(check + ["--resumed", str(path)])

    assert resumed("good") == 0
    assert resumed("drifted", shift=0.05) == 1
    assert resumed("restarted", start_step=0) == 1
    assert resumed("lr", lrs={15: 2e-3}) == 1
    output = capsys.readouterr().out
    assert "resume check passed" in output and "did not load the checkpoint" in output
    assert "the scheduler did not resume" in output
    assert plot_losses.main(check + ["--resumed", str(tmp_path / "absent")]) == 1
    assert "resumed run: " + str(tmp_path / "absent") + ": missing" in capsys.readouterr().out


def test_plot_summary_and_png(tmp_path, plot_losses, capsys):
    stock = {s: 5.0 - 0.01 * s for s in range(1, 31)}
    balanced = {(0, 0): 100, (0, 1): 100, (1, 0): 150, (1, 1): 50}
    write_monitor(tmp_path / "stock", stock, expert_tokens=balanced)
    write_monitor(
        tmp_path / "comet",
        {s: v + (0.02 if s == 7 else 0.0) for s, v in stock.items()},
        summary=dict(moe_forward_ms=1.5, moe_backward_ms=2.25, optimizer_ms=4.0, rest_ms=3.0),
    )
    png = tmp_path / "curves.png"
    runs = [f"stock={tmp_path / 'stock'}", f"comet={tmp_path / 'comet'}"]
    status = plot_losses.main(["plot", "--out", str(png), "--json", str(tmp_path / "s.json")] + runs)
    if importlib.util.find_spec("matplotlib") is not None:
        assert status == 0
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 2000
    else:
        assert status == 3 and not png.exists()
    output = capsys.readouterr().out
    assert "max |loss diff| 0.0200 at step 7" in output and "1.000x" in output
    # Only the run that timed its steps' parts (--step-shares) has a row of them.
    assert "| comet | 3.75 (1.50 + 2.25) | 4.00 | 3.00 |" in output
    assert "| stock | " not in output.split("MoE layers")[1]
    # The busiest expert: layer 1's expert 0 got 150 of 200 tokens, 1.5 x the mean of 100.
    assert json.loads((tmp_path / "s.json").read_text())["runs"][0]["busiest_expert_share"] == 1.5
    assert plot_losses.main(["plot", "--max-diff-tol", "0.01"] + runs) == 1
    assert plot_losses.main(["plot", f"missing={tmp_path / 'none'}"] + runs) == 2


def test_plot_reads_the_trainer_examples_loss_lines(tmp_path, plot_losses, capsys):
    write_monitor(tmp_path / "monitor", {s: 4.0 - 0.02 * s for s in range(1, 11)})
    lines = tmp_path / "trainer.jsonl"
    records = [{"step": s, "loss": 4.0 - 0.02 * s + (0.05 if s == 4 else 0.0)} for s in range(1, 11)]
    lines.write_text("".join(json.dumps(r) + "\n" for r in records) + "not json\n")
    assert plot_losses.main(["plot", f"bf16={tmp_path / 'monitor'}", f"fp8={lines}"]) == 0
    output = capsys.readouterr()
    assert "max |loss diff| 0.0500 at step 4" in output.out
    assert "| fp8 | - | 10 |" in output.out and "| 3.8000 |" in output.out  # its final loss: the last step's
    assert "trainer.jsonl:11: not a step/loss record, skipped" in output.err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert plot_losses.main(["plot", f"bf16={tmp_path / 'monitor'}", f"none={empty}"]) == 2


def test_plot_without_matplotlib_fails_with_the_reason(tmp_path):
    # matplotlib present or not on this machine, the tool runs here as if it could not be imported.
    write_monitor(tmp_path / "run", {s: 5.0 - 0.01 * s for s in range(1, 11)})
    png = tmp_path / "curves.png"
    no_matplotlib = (
        "import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = sys.argv[1:]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    done = subprocess.run(
        [sys.executable, "-c", no_matplotlib, PLOT_LOSSES, "plot", "--out", str(png), f"run={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3, (done.returncode, done.stdout, done.stderr)
    assert f"cannot draw {png}: matplotlib cannot be imported" in done.stderr, done.stderr
    assert not png.exists()
    # Without --out it was not asked to draw: the table alone is a success.
    done = subprocess.run(
        [sys.executable, "-c", no_matplotlib, PLOT_LOSSES, "plot", f"run={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and "| run |" in done.stdout, done.stdout + done.stderr


def test_rounds_ratios_per_round(tmp_path, plot_losses, capsys):
    def run(name, tokens, memory):
        path = write_monitor(
            tmp_path / name, {1: 3.0, 2: 2.9}, summary=dict(steady_tokens_per_s=tokens, peak_memory_mib=memory)
        )
        return f"{name.replace('_', '/')}={path}"

    # The host drifts between rounds: comet is 1.2x and 1.5x of the stock run beside it, not of stock's mean.
    runs = [
        run("stock_1", 100.0, 50.0),
        run("comet_1", 120.0, 40.0),
        run("stock_2", 80.0, 50.0),
        run("comet_2", 120.0, 45.0),
    ]
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
    # One write per rank: print(*values) writes each value apart, and unbuffered ranks then interleave.
    report = (
        "import os, sys; sys.stdout.write(' '.join(os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', "
        "'MASTER_PORT')) + '\\n')"
    )
    done = subprocess.run(
        ["bash", SHARED_RANKS, "3", "29599", sys.executable, "-c", report], capture_output=True, text=True, timeout=60
    )
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
    done = subprocess.run(
        ["bash", SHARED_RANKS, "3", "29598", sys.executable, "-c", SHARED_RANKS_CASE, pid_file, "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 7, (done.returncode, done.stderr)
    assert time.monotonic() - began < 60
    assert all(_wait_gone(int(pid), 10) for pid in open(pid_file).read().split()), "rank 0 outlived the launcher"


@pytest.mark.parametrize("ignore_term", [False, True], ids=["term", "kill-after-grace"])
def test_shared_gpu_ranks_stops_every_rank_on_term(tmp_path, ignore_term):
    pid_file = str(tmp_path / "child.pid")
    command = ["bash", SHARED_RANKS, "2", "29596", sys.executable, "-c", SHARED_RANKS_CASE, pid_file, "1"]
    launcher = subprocess.Popen(
        command + (["ignore-term"] if ignore_term else []),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=dict(os.environ, GRACE_S="1"),
    )
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
@pytest.mark.parametrize("knob", ["AB_ROUNDS", "NRANKS", "RUN_LIMIT_S", "GRAD_ACCUM", "MICRO_BATCH"])
def test_train_compare_checks_its_knobs(tmp_path, shared, knob):
    # A bad knob stops the script with its own message; AB_ROUNDS is checked after the setup every
    # mode runs (a failing statement there would stop it earlier, silently, under set -e).
    env = dict(os.environ, TRAIN_COMPARE_CPU="1", TRAIN_COMPARE_SHARED_GPU=shared, OUT=str(tmp_path / "out"))
    env[knob] = "0"
    done = subprocess.run(
        ["bash", os.path.join(REPO, "scripts", "train_compare.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    assert f"{knob} must be a positive integer" in done.stderr


def test_train_compare_refuses_mpirun_check_without_its_baseline(tmp_path):
    # (c) compares the mpirun losses with (a)'s comet run: without (a) it would compare with nothing.
    env = dict(os.environ, TRAIN_COMPARE_CPU="1", PARTS="bc", OUT=str(tmp_path / "out"))
    done = subprocess.run(
        ["bash", os.path.join(REPO, "scripts", "train_compare.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    assert "(c) compares with (a)'s comet run" in done.stderr
