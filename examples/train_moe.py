"""Train a small MoE language model with DeepSpeed and the ds_comet MoE backend.

The model (examples/moe_lm.py) is a decoder-only transformer over raw bytes whose feed-forward
blocks are MoE layers built with ``ds_comet.build_moe``: the ds_config's ``"moe"`` section picks
the comet backend or stock DeepSpeed's. It trains on the Python standard library's own source, so
the example needs no download. Launch it with any of::

    deepspeed --num_gpus 2 examples/train_moe.py --deepspeed_config configs/zero2_comet.json
    torchrun --nproc_per_node 2 examples/train_moe.py --deepspeed_config configs/zero2_comet.json
    mpirun -np 2 python examples/train_moe.py --deepspeed_config configs/zero2_comet.json

On CPU it trains in fp32 over gloo; on GPU it turns bf16 on unless the config enables bf16 or fp16.
``--preset gpu`` picks an MoE-heavy model for GPUs, ``--preset gpu-fine`` one with fine-grained
experts (``--help`` lists their sizes); explicit options still override them. ``--hf-model mixtral``
(or ``qwen3_moe``) trains a Hugging Face model of the same sizes instead, with random weights, under
DeepSpeed AutoEP: the example adds an ``"expert_parallel"`` section to the ds_config unless it has
one, and ``"moe"`` then picks AutoEP alone (``"deepspeed"``) or AutoEP on ds_comet (``"comet"``).

The steps of a run are the functions ``main`` calls, in order. The optimizer is torch's AdamW (fused
on CUDA). Metrics go through DeepSpeed's monitor (``ds_comet.training_metrics`` lists them; a
Hugging Face model's aux loss is 0, its configs adding no load-balancing loss by default);
``--monitor-dir DIR`` enables csv_monitor with its files in DIR. ``--step-shares`` times the MoE
layers, the optimizer step and the rest of each timed step (``ds_comet.step_shares``). Checkpoints
(``--save-dir``) are directories ``step{N}`` saved through ``ds_comet.checkpoints``, with a
``SHA256SUMS`` manifest and ``run.json``, the flags and rank count their shapes depend on;
``--resume`` continues from ``latest`` and ``--resume-tag TAG`` from TAG once both are checked; a
``--save-dir`` the run cannot write is refused before it trains. The ds_config's ``"moe":
{"wait_timeout_s"}`` bounds every wait on a peer, the layers' and the example's own, and sets the
process groups' timeout (``ds_comet.launch.init_distributed``, ``ds_comet.collectives``): a rank that
stops ends the others by name. Each rank exits when its launcher is gone.
"""

import argparse
import contextlib
import math
import os
import sys
import time

import deepspeed
import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from deepspeed.utils import set_log_level_from_string
from moe_lm import (
    HF_MODELS,
    AutoEPCausalLMForward,
    ByteLMForward,
    ByteMoELM,
    Windows,
    add_expert_parallel_section,
    derived_seed,
    hf_moe_model,
    init_experts_,
    stdlib_corpus,
)
from tqdm import tqdm

import ds_comet
import ds_comet.launch
import ds_comet.step_shares
from ds_comet import checkpoints, collectives
from ds_comet.training_metrics import TrainingMetrics, sum_over_ranks, values_of_ranks

EVAL_FRACTION = 0.05
# Steps after a resume whose losses every rank checks together: a checkpoint with non-finite model
# weights fails at the first, one with non-finite optimizer state (fp32 master weights, moments)
# from the second on.
RESUME_FINITE_CHECK_STEPS = 5
# Defaults that --preset replaces; options given on the command line still win.
GPU_TRAINING = dict(lr=1e-3, warmup=20, log_interval=10, timing_warmup=10)
PRESETS = {
    # MoE-dominated: with 8 x 1024 windows per rank (configs/gpu_*.json) every MoE layer call gets
    # 8192 tokens per rank; the experts hold ~95 % of the weights and do ~75 % of the model FLOPs.
    "gpu": dict(layers=4, hidden=1024, ffn=4096, heads=16, seq_len=1024, experts=8, k=2, **GPU_TRAINING),
    # Fine-grained experts (the MoE shape of Qwen1.5-MoE and DeepSeek-MoE: 64 experts of 1408, top-4).
    "gpu-fine": dict(layers=4, hidden=2048, ffn=1408, heads=16, seq_len=1024, experts=64, k=4, **GPU_TRAINING),
}


# Arguments and config


def checked(kind, accept, words):
    """An argparse type: ``kind(text)``, refused as "must be <words>" unless ``accept(value)``."""

    def parse(text):
        value = kind(text)
        if not accept(value):
            raise argparse.ArgumentTypeError(f"must be {words}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse's "invalid int value: 'x'" for text that is no number
    return parse


positive_int = checked(int, lambda value: value >= 1, "a positive integer")
non_negative_int = checked(int, lambda value: value >= 0, "0 or more")
positive_float = checked(float, lambda value: 0 < value < math.inf, "a positive number")


def add_model_options(parser):
    model = parser.add_argument_group("model")
    model.add_argument("--layers", type=positive_int, default=2, help="transformer blocks")
    model.add_argument("--hidden", type=positive_int, default=64, help="model width")
    model.add_argument("--ffn", type=positive_int, default=128, help="hidden size of each expert (and of dense FFNs)")
    model.add_argument("--heads", type=positive_int, default=4, help="attention heads")
    model.add_argument("--seq-len", type=positive_int, default=64, help="bytes per training window")
    model.add_argument("--moe-every", type=positive_int, default=1, help="every N-th block is MoE (2: every other one)")
    model.add_argument("--gated", action="store_true", help="SwiGLU experts (GatedFeedForward) instead of GELU ones")
    model.add_argument(
        "--hf-model",
        choices=sorted(HF_MODELS),
        help="train this Hugging Face MoE model (random weights, the sizes above) under DeepSpeed AutoEP "
        "instead; its experts are SwiGLU and drop no tokens (--gated, --moe-every, capacity do not apply)",
    )
    moe = parser.add_argument_group("mixture of experts")
    moe.add_argument("--experts", type=positive_int, help="experts per MoE layer (default: 4 x world size)")
    moe.add_argument("--ep-size", type=positive_int, help="expert-parallel size (default: world size)")
    moe.add_argument("--k", type=positive_int, default=2, help="experts per token (top-k)")
    moe.add_argument("--capacity-factor", type=float, default=1.25)
    moe.add_argument("--eval-capacity-factor", type=float, default=2.0)
    moe.add_argument("--min-capacity", type=non_negative_int, default=4)
    moe.add_argument(
        "--aux-coef", type=float, default=0.01, help="weight of the load-balancing loss (1.0 a balanced layer)"
    )


def add_training_options(parser):
    train = parser.add_argument_group("training")
    train.add_argument(
        "--steps", type=positive_int, default=60, help="optimizer steps in all (a resume stops here too)"
    )
    train.add_argument("--lr", type=float, default=3e-3)
    train.add_argument("--weight-decay", type=float, default=0.01)
    train.add_argument("--warmup", type=non_negative_int, default=5, help="linear learning-rate warm-up steps")
    train.add_argument("--seed", type=int, default=1234)
    train.add_argument(
        "--corpus-mb", type=positive_float, default=4.0, help="MB of standard-library source to train on"
    )
    train.add_argument(
        "--eval-batches", type=non_negative_int, default=4, help="held-out batches per rank (0: no eval)"
    )
    train.add_argument("--log-interval", type=positive_int, default=10, help="print (and time) a window of N steps")
    train.add_argument(
        "--timing-warmup", type=non_negative_int, default=5, help="steps left out of the steady tokens/s"
    )
    train.add_argument(
        "--step-shares", action="store_true", help="print the MoE layers', optimizer's and rest's shares"
    )
    train.add_argument("--monitor-dir", metavar="DIR", help="enable csv_monitor, its files in DIR (a resume appends)")
    train.add_argument("--save-dir", help="checkpoint directory")
    train.add_argument(
        "--save-interval", type=non_negative_int, default=0, help="save every N steps (0: only at the end)"
    )
    train.add_argument("--save-at", type=int, nargs="+", default=[], metavar="STEP", help="also save after these steps")
    train.add_argument("--no-final-save", action="store_true", help="save only at --save-interval / --save-at steps")
    train.add_argument("--resume", action="store_true", help="continue from --save-dir's 'latest' checkpoint")
    train.add_argument("--resume-tag", metavar="TAG", help="continue from checkpoint TAG in --save-dir (e.g. step20)")
    train.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error", "critical"),
        help="DeepSpeed's logger (default: warning); info also says which pipeline the comet layers run and why",
    )


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--local_rank",
        "--local-rank",
        type=int,
        default=-1,
        help="set by the deepspeed launcher; the script reads LOCAL_RANK from the environment",
    )
    parser.add_argument(
        "--dist-backend",
        choices=("nccl", "gloo"),
        help="torch.distributed backend (default: DeepSpeed's for the accelerator); gloo lets ranks share a "
        "GPU (scripts/shared_gpu_ranks.sh); with GPUs it needs the ranks in the environment (a launcher, or "
        "a one-node mpirun)",
    )
    presets = "; ".join(
        f"{name}: " + ", ".join(f"{k}={v}" for k, v in values.items()) for name, values in PRESETS.items()
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), help=f"a set of defaults: {presets}")
    add_model_options(parser)
    add_training_options(parser)
    deepspeed.add_config_arguments(parser)
    preset, _ = parser.parse_known_args(argv)
    if preset.preset:
        parser.set_defaults(**PRESETS[preset.preset])
    args = parser.parse_args(argv)
    if not args.deepspeed_config:
        parser.error("--deepspeed_config is required")
    args.resume = args.resume or bool(args.resume_tag)
    if args.resume and not args.save_dir:
        parser.error("--resume and --resume-tag need --save-dir")
    if args.hf_model and (args.gated or args.moe_every != 1):
        parser.error("--gated and --moe-every describe the byte-level model; a --hf-model has SwiGLU experts")
    if args.hidden % args.heads:
        parser.error(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads})")
    return args


def training_config(source, monitor_dir=None):
    """The ds_config (``ds_comet.read_ds_config``) as this example trains with it; exits naming a bad one.

    On an accelerator it turns bf16 on unless the config enables bf16 or fp16 already. ``monitor_dir``
    enables csv_monitor with its files directly in that directory (DeepSpeed writes to output_path/job_name).
    """
    try:
        config = ds_comet.read_ds_config(source)
    except (OSError, ValueError) as error:
        raise SystemExit(f"--deepspeed_config: {error}") from None
    if get_accelerator().device_name() != "cpu":
        if not any(config.get(key, {}).get("enabled", False) for key in ("bf16", "bfloat16", "fp16")):
            config["bf16"] = {"enabled": True}
    if monitor_dir:
        path = os.path.abspath(monitor_dir)
        csv_monitor = dict(enabled=True, output_path=os.path.dirname(path), job_name=os.path.basename(path))
        config["csv_monitor"] = dict(config.get("csv_monitor") or {}, **csv_monitor)
    return config


def stop_all_ranks(message):
    """Ends the run on every rank, which all call it with the same message: rank 0 prints it, then all
    exit with status 1 together (a rank that left first could have a launcher kill rank 0 before it printed)."""
    if dist.get_rank() == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    collectives.barrier("stopping every rank")
    dist.destroy_process_group()
    raise SystemExit(1)


def load_data(args, rank):
    """(training windows, held-out windows) of this rank; exits when a part is shorter than a window."""
    corpus = stdlib_corpus(int(args.corpus_mb * 2**20))
    split = int(corpus.numel() * (1 - EVAL_FRACTION))
    parts = {"training": split, **({"held-out": corpus.numel() - split} if args.eval_batches else {})}
    for part, size in parts.items():
        if size < args.seq_len + 2:  # a window and its next-byte target
            raise SystemExit(
                f"--corpus-mb {args.corpus_mb} gives a {part} part of {size} bytes, shorter than a "
                f"window of --seq-len {args.seq_len} (+2): raise --corpus-mb or lower --seq-len"
            )
    return tuple(Windows(part, args.seq_len, args.seed, rank) for part in (corpus[:split], corpus[split:]))


def moe_optimizer(lr, weight_decay, fused):
    """The optimizer DeepSpeed builds, when it calls it, from the model's parameters as they are then.

    Given to deepspeed.initialize as a callable rather than as an optimizer: AutoEP replaces a
    Hugging Face model's MoE blocks inside initialization, and only then are the expert weights the
    stacked, per-rank tensors tagged as expert parameters (allreduce False), which ZeRO needs in
    param groups of their own ("moe": True). An optimizer built before that would hold the
    discarded weights; DeepSpeed re-points it at the new ones, but into the group their sources
    were in, the dense one, which ZeRO then refuses. A callable gets the converted parameters and
    splits them as an optimizer made before initialize would for a model built with MoE layers (the
    byte-level model), so both models train with the same AdamW and scheduler. ``fused``: torch's
    fused CUDA AdamW (the parameters are on a GPU).
    """

    def build(parameters):
        groups = split_params_into_different_moe_groups_for_optimizer({"params": list(parameters), "name": "dense"})
        return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95), fused=fused or None)

    return build


def moe_layer_classes(module):
    """{class name: count} of the MoE layers that run in ``module`` (stock's, AutoEP's, ds_comet's)."""
    from ds_comet.integrations.layer_classes import moe_layers

    found = {}
    for layer in moe_layers(module):
        found[type(layer).__name__] = found.get(type(layer).__name__, 0) + 1
    return found


# The steps of a run


def checkpoint_to_resume(args):
    """The tag --resume / --resume-tag asks for; exits with the reason when there is none (before any process group)."""
    try:
        return checkpoints.find_checkpoint(args.save_dir, args.resume_tag)
    except checkpoints.CheckpointNotFoundError as error:
        if args.resume_tag:
            raise SystemExit(f"error: --resume-tag: {error}") from None
        advice = "start without --resume, or name a checkpoint with --resume-tag"
        raise SystemExit(f"error: --resume: {error}; {advice}") from None


def check_save_dir(args):
    """Exits naming --save-dir when the run would save into it but cannot write there (before any process group)."""
    if args.save_dir and (args.save_interval or args.save_at or not args.no_final_save):
        try:
            checkpoints.check_writable(args.save_dir)
        except checkpoints.CheckpointError as error:
            raise SystemExit(f"error: --save-dir: {error}") from None


def build_model(args, ds_config, rank, world_size):
    """(model, expert-parallel size, experts per MoE layer): the byte-level model, or the --hf-model under AutoEP."""
    ep_size = args.ep_size or world_size
    num_experts = args.experts or 4 * world_size
    if world_size % ep_size or num_experts % ep_size:
        raise SystemExit(f"--ep-size {ep_size} must divide the world size ({world_size}) and --experts ({num_experts})")
    torch.manual_seed(args.seed)  # dense weights: the same on every rank
    if args.hf_model:
        on_cpu = get_accelerator().device_name() == "cpu"
        model = hf_moe_model(args, num_experts)
        ep_size = add_expert_parallel_section(ds_config, args.hf_model, ep_size, on_cpu).get("autoep_size", 1)
    else:
        model = ByteMoELM(args, ds_config, num_experts, ep_size)
        init_experts_(model, args.seed, rank, ep_size)
    return model, ep_size, num_experts


def run_shape(args, world_size, ep_size, num_experts):
    """What a checkpoint's parameter shapes and files depend on, by flag: a resume must match it."""
    flags = ("hf_model", "layers", "hidden", "ffn", "heads", "seq_len")
    if not args.hf_model:  # the byte-level model's own options (a Hugging Face model ignores them)
        flags += ("moe_every", "gated")
    shape = {"ranks": world_size, "--ep-size": ep_size, "--experts": num_experts}
    shape.update({"--" + flag.replace("_", "-"): getattr(args, flag) for flag in flags})
    return shape


def build_engine(args, model, ds_config):
    """(engine, forward): ``ds_comet.initialize`` (deepspeed.initialize, AutoEP's conversion under
    "expert_parallel", then the MoE layers on the backend "moe" names), and the training loop's forward."""
    warmup = max(1, args.warmup)
    # The scheduler, like the optimizer (moe_optimizer says why), is built by DeepSpeed once the optimizer exists.
    scheduler = lambda optimizer: torch.optim.lr_scheduler.LambdaLR(  # noqa: E731
        optimizer, lambda step: min(1.0, (step + 1) / warmup)
    )
    fused_adamw = get_accelerator().device_name() == "cuda"  # torch's fused AdamW runs on CUDA devices
    optimizer = moe_optimizer(args.lr, args.weight_decay, fused_adamw)
    with collectives.peers_named("building the engine"):
        engine, _, _, _ = ds_comet.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
        )
    if args.save_dir:
        try:
            checkpoints.require_synchronous_saves(engine)
        except checkpoints.CheckpointError as error:
            stop_all_ranks(f"--save-dir: {error}")
    return engine, AutoEPCausalLMForward(engine) if args.hf_model else ByteLMForward(engine, model)


def resume(args, engine, tag, shape):
    """Loads checkpoint ``tag`` once its files and run shape are checked; returns its step."""
    try:
        load_path, client_state = checkpoints.load_checkpoint(engine, args.save_dir, tag, shape)
    except checkpoints.DamagedCheckpointError as error:
        advice = f": resume from it with --resume-tag {error.intact}" if error.intact else ""
        stop_all_ranks(f"{error}{advice}")
    except checkpoints.RunShapeMismatchError as error:
        stop_all_ranks(f"{error}; resume with the flags and the number of ranks it was saved with")
    except checkpoints.CheckpointError as error:
        stop_all_ranks(str(error))
    step = int(client_state["step"])
    if dist.get_rank() == 0:
        print(f"resumed from {load_path} at step {step} (its files match {tag}/{checkpoints.MANIFEST})", flush=True)
    return step


def describe_run(args, ds_config, engine, ep_size, num_experts, params, from_mpi):
    """Rank 0's lines about the run: where the ranks came from, the model, the engine, the monitor."""
    if dist.get_rank() != 0:
        return
    if from_mpi:
        mpi = f"MASTER_ADDR {from_mpi['MASTER_ADDR']}, MASTER_PORT {from_mpi['MASTER_PORT']}"
        print(f"ranks from the MPI launcher's environment ({mpi})", flush=True)
    layers = ", ".join(f"{count} x {name}" for name, count in moe_layer_classes(engine.module).items())
    print(
        f"model {args.hf_model or 'byte-level'} | world size {dist.get_world_size()} | ep size {ep_size} | "
        f"experts {num_experts} | k {args.k} | backend {ds_comet.moe_config_from(ds_config).backend} | moe layers "
        f"{layers or 'none'} | params on rank 0 {params} | micro batch {engine.train_micro_batch_size_per_gpu()} | "
        f"grad accum {engine.gradient_accumulation_steps()} | dtype {next(engine.module.parameters()).dtype} | "
        f"device {torch.device(engine.device)}",
        flush=True,
    )
    if engine.monitor.csv_monitor is not None:
        print(f"csv_monitor writes to {engine.monitor.csv_monitor.log_dir}", flush=True)


def log(bar, line):
    """Prints a line of rank 0's log, above the progress bar while one is shown."""
    if bar.disable:
        print(line, flush=True)
    else:
        bar.write(line)


def save(args, engine, step, shape, bar):
    """Saves checkpoint step{step} (``ds_comet.checkpoints``); returns the seconds it took."""
    began = time.perf_counter()
    saved = checkpoints.save_checkpoint(engine, args.save_dir, f"step{step}", {"step": step}, shape)
    if dist.get_rank() == 0:
        log(
            bar,
            f"saved checkpoint {saved.path}: {saved.files} files, {saved.size_bytes / 2**20:.1f} MiB, "
            f"sha256 in {checkpoints.MANIFEST}; {checkpoints.LATEST} -> step{step}",
        )
    return time.perf_counter() - began


def train_step(args, engine, forward, windows, step, shares):
    """One optimizer step over the gradient-accumulation micro-batches: (mean LM loss, mean aux loss,
    the tokens each gate routed to each expert)."""
    grad_accum, device = engine.gradient_accumulation_steps(), torch.device(engine.device)
    step_lm = step_aux = 0.0
    step_counts = None
    # A rank that stops in the step leaves its peers in a collective of DeepSpeed's (the gradients'
    # reduction): past the process groups' timeout, their error names it.
    with collectives.peers_named(f"training step {step}"):
        for micro in range(grad_accum):
            ids, targets = windows.batch(engine.train_micro_batch_size_per_gpu(), step, micro)
            # The gate's random draws (top-2 sampling, random token selection) depend on the step
            # alone, so a resumed run takes the same ones as an uninterrupted run.
            torch.manual_seed(derived_seed("noise", args.seed, windows.rank, step, micro))
            lm_loss, aux, counts = forward(ids.to(device), targets.to(device))
            engine.backward(lm_loss + args.aux_coef * aux)
            with shares.optimizer() if shares else contextlib.nullcontext():
                engine.step()
            step_lm += lm_loss.item() / grad_accum
            step_aux += aux.item() / grad_accum
            step_counts = counts if step_counts is None else step_counts + counts
    return step_lm, step_aux, step_counts


def stop_unless_finite(args, step, losses, metrics, tag):
    """After a resume: stops every rank when a rank's (LM loss, aux loss) of ``step`` is not finite."""
    per_rank = values_of_ranks(list(losses), metrics.device)
    bad = [(r, lm, aux) for r, (lm, aux) in enumerate(per_rank) if not (math.isfinite(lm) and math.isfinite(aux))]
    if bad:
        ranks = "; ".join(f"rank {r}: loss {lm}, aux {aux}" for r, lm, aux in bad)
        stop_all_ranks(
            f"step {step}: the loss is not finite ({ranks}), {step - metrics.start_step} step(s) after "
            f"resuming from checkpoint {tag} in {args.save_dir}; that checkpoint does not train: resume "
            "from an earlier one with --resume-tag, or start afresh"
        )


def train(args, engine, forward, windows, metrics, shape, resumed_tag, bar):
    """The training loop, steps after ``metrics.start_step`` to ``args.steps``; returns the last step saved."""
    shares = metrics.step_shares
    saved_step = metrics.start_step if resumed_tag else None
    engine.train()
    metrics.start()
    for step in range(metrics.start_step + 1, args.steps + 1):
        lr = engine.get_lr()[0]  # the rate this step's update uses (the scheduler steps inside engine.step)
        with shares.step(measure=step > metrics.timing_from) if shares else contextlib.nullcontext():
            lm, aux, counts = train_step(args, engine, forward, windows, step, shares)
        metrics.record_step(step, lm, aux, lr, counts)
        bar.update(1)
        if resumed_tag and step <= metrics.start_step + RESUME_FINITE_CHECK_STEPS:
            stop_unless_finite(args, step, (lm, aux), metrics, resumed_tag)
        if step % args.log_interval == 0 or step == args.steps:
            window = metrics.end_window(step)
            if dist.get_rank() == 0:
                line = f"step {step} | loss {window.loss:.4f} | aux {window.aux_loss:.4f}"
                log(bar, f"{line} | tokens/s {window.tokens_per_s:.0f}")
                bar.set_postfix(loss=f"{window.loss:.3f}")
        if args.save_dir and ((args.save_interval and step % args.save_interval == 0) or step in args.save_at):
            metrics.leave_out(save(args, engine, step, shape, bar))
            saved_step = step
        metrics.step_done(step)
    bar.close()
    return saved_step


def evaluate(args, engine, forward, windows):
    """(LM loss, aux loss) on ``args.eval_batches`` held-out batches per rank, means over the ranks."""
    device = torch.device(engine.device)
    engine.eval()
    total_lm = total_aux = 0.0
    with torch.no_grad(), collectives.peers_named("evaluation"):
        for index in range(args.eval_batches):
            ids, targets = windows.batch(engine.train_micro_batch_size_per_gpu(), "eval", index)
            torch.manual_seed(derived_seed("eval-noise", windows.seed, windows.rank, index))
            lm_loss, aux, _ = forward(ids.to(device), targets.to(device))
            total_lm += lm_loss.item()
            total_aux += aux.item()
    engine.train()
    lm, aux = sum_over_ranks([total_lm / args.eval_batches, total_aux / args.eval_batches], device, "evaluation")
    return lm / dist.get_world_size(), aux / dist.get_world_size()


def main(argv=None):
    # Setup: arguments, config, the checkpoint to resume (before any process group), the ranks.
    args = parse_args(argv)
    if args.log_level:
        set_log_level_from_string(args.log_level)
    ds_config = training_config(args.deepspeed_config, args.monitor_dir)
    resume_tag = checkpoint_to_resume(args) if args.resume else None
    check_save_dir(args)
    # The process groups' timeout, and the bound of the example's own collectives, from "moe": {"wait_timeout_s"};
    # each rank exits when its launcher is gone.
    from_mpi = ds_comet.launch.init_distributed(args.dist_backend, ds_config)
    rank, world_size = dist.get_rank(), dist.get_world_size()

    # Model, data and engine.
    model, ep_size, num_experts = build_model(args, ds_config, rank, world_size)
    train_windows, eval_windows = load_data(args, rank)
    shape = run_shape(args, world_size, ep_size, num_experts)
    engine, forward = build_engine(args, model, ds_config)
    start_step = resume(args, engine, resume_tag, shape) if resume_tag else 0

    # Train.
    params = sum(p.numel() for p in engine.module.parameters())
    describe_run(args, ds_config, engine, ep_size, num_experts, params, from_mpi)
    micro_batch, grad_accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    shares = ds_comet.step_shares.StepShares(engine.module, torch.device(engine.device)) if args.step_shares else None
    metrics = TrainingMetrics(
        engine,
        tokens_per_step=micro_batch * grad_accum * args.seq_len * world_size,
        moe_blocks=forward.moe_blocks,
        num_experts=forward.num_experts,
        start_step=start_step,
        last_step=args.steps,
        timing_warmup=args.timing_warmup,
        step_shares=shares,
    )
    metrics.write_run_info(params)
    show_bar = rank == 0 and sys.stderr.isatty()
    bar = tqdm(total=args.steps, initial=start_step, disable=not show_bar, dynamic_ncols=True)
    saved_step = train(args, engine, forward, train_windows, metrics, shape, resume_tag, bar)
    summary = metrics.finish()

    # Save, evaluate, summarise.
    final_step = max(start_step, args.steps)
    if args.save_dir and not args.no_final_save and saved_step != final_step:
        save(args, engine, final_step, shape, bar)
    if rank == 0:
        for line in metrics.describe(summary):
            print(line, flush=True)
    if args.eval_batches > 0:
        summary["eval_loss"], summary["eval_aux_loss"] = evaluate(args, engine, forward, eval_windows)
        if rank == 0:
            eval_lm, eval_aux = summary["eval_loss"], summary["eval_aux_loss"]
            print(f"eval loss {eval_lm:.4f} (ppl {math.exp(eval_lm):.2f}, aux {eval_aux:.4f})", flush=True)
    metrics.write_summary(summary, final_step)
    # Leave together: a rank that exits while another still uses the process group (rank 0 hosts
    # its store) makes the other's NCCL heartbeat monitor complain.
    collectives.barrier("the end of the run")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
