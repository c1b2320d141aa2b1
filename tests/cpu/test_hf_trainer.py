"""examples/train_hf_trainer.py: the Hugging Face Trainer on DeepSpeed with AutoEP, with and without
the comet backend, under the launchers its users start it with (CPU, gloo ranks, fp32).

The script's only ds_comet line is ``import ds_comet``; the ds_config says the rest. Every run of a
model takes the same seed and data, so the comet runs must give AutoEP's own losses: under the
deepspeed launcher (ZeRO-2, Mixtral), torchrun (ZeRO-3, Qwen3-MoE) and ``accelerate launch`` with its
DeepSpeed plugin (ZeRO-2, Mixtral). Each comet run says, at the log level the Trainer leaves, what its
layers run on (a model without MoE layers: test_engine_hook.py).
"""

import json
import os
import shutil
import sys

import pytest

from tests.support.dist_pool import cpu_world_size, free_port
from tests.support.launches import REPO, run_launch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SCRIPT = os.path.join(REPO, "examples", "train_hf_trainer.py")
RANKS = cpu_world_size()
STEPS = 5
TIMEOUT_S = 300


def trainer_config(tmp_path, stage: int, backend: str, **moe) -> str:
    """The shipped Trainer config of ZeRO ``stage`` with ``backend``, AutoEP over every rank."""
    with open(os.path.join(REPO, "configs", f"hf_trainer_zero{stage}_comet.json")) as handle:
        config = json.load(handle)
    config["expert_parallel"]["autoep_size"] = RANKS
    config["moe"] = {"backend": backend, **moe}
    path = tmp_path / f"zero{stage}_{backend}.json"
    path.write_text(json.dumps(config))
    return str(path)


def train(tmp_path, launcher: str, config: str, model: str, steps: int = STEPS) -> tuple[list[float], str]:
    """(the logged losses by step, the combined output) of one run of the script under ``launcher``."""
    port = free_port()
    losses = tmp_path / f"losses_{port}.jsonl"
    script = [
        SCRIPT,
        "--deepspeed",
        config,
        "--model",
        model,
        "--max-steps",
        str(steps),
        "--losses",
        str(losses),
        "--output-dir",
        str(tmp_path / "out"),
    ]
    if launcher == "deepspeed":
        cmd = [shutil.which("deepspeed"), "--num_gpus", str(RANKS), "--master_port", str(port), *script]
    elif launcher == "torchrun":
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(RANKS),
            "--master_port",
            str(port),
            *script,
        ]
    else:
        cmd = [
            shutil.which("accelerate"),
            "launch",
            "--use_deepspeed",
            "--deepspeed_config_file",
            config,
            "--num_processes",
            str(RANKS),
            "--main_process_port",
            str(port),
            *script,
        ]
    returncode, output, _ = run_launch(cmd, port, TIMEOUT_S)
    assert returncode == 0, f"exit status {returncode}\n$ {' '.join(cmd)}\n{output[-5000:]}"
    with open(losses) as handle:
        logged = [json.loads(line) for line in handle]
    assert [entry["step"] for entry in logged] == list(range(1, steps + 1)), logged
    return [entry["loss"] for entry in logged], output


def comet_said(output: str) -> list[str]:
    return [line for line in output.splitlines() if "run the comet backend" in line]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_trainer")


@pytest.mark.skipif(shutil.which("deepspeed") is None, reason="the deepspeed launcher is not on PATH")
def test_deepspeed_launcher_zero2_mixtral_and_accelerate_launch_match_autoep(workdir):
    autoep, autoep_output = train(workdir, "deepspeed", trainer_config(workdir, 2, "deepspeed"), "mixtral")
    assert not comet_said(autoep_output), "a job without comet must stay DeepSpeed's"
    comet, output = train(workdir, "deepspeed", trainer_config(workdir, 2, "comet"), "mixtral")
    assert comet == pytest.approx(autoep, rel=1e-5), (autoep, comet)
    assert comet[-1] < comet[0], comet
    # One line for the job, from rank 0, at WARNING: the Trainer leaves DeepSpeed's logger there.
    assert len(comet_said(output)) == 1, output[-3000:]
    assert "2 MoE layer(s) run the comet backend: 2 on the reference pipeline" in comet_said(output)[0]
    if shutil.which("accelerate") is None:
        pytest.skip("accelerate's launcher is not on PATH")
    accelerated, output = train(workdir, "accelerate", trainer_config(workdir, 2, "comet"), "mixtral")
    assert accelerated == pytest.approx(autoep, rel=1e-5), (autoep, accelerated)
    assert len(comet_said(output)) == 1, output[-3000:]


def test_torchrun_zero3_qwen3_moe_matches_autoep(workdir):
    autoep, _ = train(workdir, "torchrun", trainer_config(workdir, 3, "deepspeed"), "qwen3_moe")
    comet, output = train(workdir, "torchrun", trainer_config(workdir, 3, "comet"), "qwen3_moe")
    assert comet == pytest.approx(autoep, rel=1e-5), (autoep, comet)
    assert len(comet_said(output)) == 1, output[-3000:]
