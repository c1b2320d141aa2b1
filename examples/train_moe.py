"""Train a small byte-level MoE language model with DeepSpeed and the ds_comet MoE backend.

The model is a decoder-only transformer over raw bytes (vocabulary 256) whose feed-forward
blocks are MoE layers built with ``ds_comet.build_moe``: the ds_config's ``"moe"`` section picks
the comet backend or stock DeepSpeed's. The text is the Python standard library's own source,
so the example needs no download.

Launch it with any of::

    deepspeed --num_gpus 2 examples/train_moe.py --deepspeed_config configs/zero2_comet.json
    torchrun --nproc_per_node 2 examples/train_moe.py --deepspeed_config configs/zero2_comet.json
    mpirun -np 2 python examples/train_moe.py --deepspeed_config configs/zero2_comet.json

On CPU it trains in fp32 over gloo; on GPU it turns bf16 on unless the config already enables
bf16 or fp16. ``--preset gpu`` picks an MoE-heavy model for GPUs (4 MoE blocks, hidden 1024,
experts of 4096, 8 experts, top-2, 1024-byte windows), ``--preset gpu-fine`` one with fine-grained
experts (hidden 2048, 64 experts of 1408, top-4); explicit options still override them::

    deepspeed --num_gpus 2 examples/train_moe.py --preset gpu --deepspeed_config configs/gpu_zero2_comet.json

``--hf-model mixtral`` (or ``qwen3_moe``) trains a Hugging Face ``MixtralForCausalLM`` (or
``Qwen3MoeForCausalLM``) instead, built from a config with random weights (no download), of the
same sizes and on the same bytes, under DeepSpeed AutoEP: the example adds an ``"expert_parallel"``
section to the ds_config unless it has one, and AutoEP converts the model's MoE blocks inside
initialization. The ``"moe"`` section then picks AutoEP alone (``"deepspeed"``) or AutoEP on
ds_comet (``"comet"``), with the same configs::

    deepspeed --num_gpus 2 examples/train_moe.py --hf-model mixtral --deepspeed_config configs/zero2_comet.json

Metrics go through DeepSpeed's monitor: whichever of the ds_config's ``csv_monitor``,
``tensorboard``, ``wandb`` and ``comet`` sections is enabled (``--monitor-dir DIR`` enables
csv_monitor with its files directly in DIR). Rank 0 writes these events, the optimizer step as x:

- every step: ``Train/Steps/loss`` and ``Train/Steps/aux_loss`` (means over the ranks) and ``Train/Steps/lr``;
  a Hugging Face model's aux loss is 0: with their configs' defaults (``output_router_logits``
  false) Mixtral and Qwen3-MoE add no load-balancing loss to their loss;
- at the end of each log window: ``Train/Steps/tokens_per_s`` and, per MoE block L and expert E,
  ``Train/Steps/expert_tokens/layer{L}_expert{E}``: the tokens the block's gate routed to the expert
  during the window, all ranks together, counted before capacity drops any (the gate's
  ``exp_counts``; under AutoEP, which drops none, the layer's ``tokens_per_expert``), so that each
  layer's counts sum to tokens x k;
- at the start step: ``Run/start_step``, ``Run/world_size``, ``Run/zero_stage``, ``Run/tokens_per_step``,
  ``Run/params_rank0``;
- at the last step: ``Summary/final_loss``, ``Summary/steady_tokens_per_s`` (steps after
  ``--timing-warmup``, checkpoint saves left out), ``Summary/step_ms``, ``Summary/timed_steps``,
  ``Summary/train_seconds``, ``Summary/peak_memory_mib`` (on an accelerator: the allocator's peak, the
  largest rank), ``Summary/eval_loss`` and ``Summary/eval_aux_loss``; with ``--step-shares``, rank 0's
  ``Summary/{moe_forward,moe_backward,optimizer,rest}_ms`` and ``..._share`` (``ds_comet.step_shares``).

The optimizer is torch's AdamW, its fused CUDA implementation on a GPU, as a real job would run
it. ``--step-shares`` times the timed steps' MoE layers (forward and backward), optimizer step and
the rest of the model on the device's clock and prints each one's share of a step, so that an
end-to-end ratio can be read against what the MoE layers took.

The engine adds its own ``Train/Samples/...`` events (x: samples).

Checkpoints (``--save-dir``) are directories ``step{N}``, each with a ``SHA256SUMS`` manifest of its
files (``sha256sum -c SHA256SUMS`` reads it) and ``run.json``, the flags and rank count its shapes
depend on. A checkpoint is written under ``step{N}.saving`` and takes its name once whole, so a save
that fails leaves an earlier checkpoint of that name as it was; ``latest`` names a checkpoint only
after every rank has written its files and the manifest exists. ``--resume`` continues from
``latest`` and ``--resume-tag TAG`` from TAG, after checking the files against the manifest and the
run against ``run.json``: a damaged checkpoint is refused with the damaged files named and the
newest intact checkpoint to resume from instead, and one saved by a run of another shape with the
flags that differ.
"""

import argparse
import base64
import binascii
import contextlib
import errno
import hashlib
import json
import math
import os
import re
import shutil
import sys
import sysconfig
import time

import deepspeed
import hjson
import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.constants import default_pg_timeout
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from deepspeed.runtime.config_utils import dict_raise_error_on_duplicate_keys
from deepspeed.utils import set_log_level_from_string
from torch import nn
from torch.nn import functional as F
from tqdm import tqdm

import ds_comet
import ds_comet.experts
import ds_comet.step_shares
from ds_comet.kernels.jit_build import build_cpu_comm_op

VOCAB = 256
EVAL_FRACTION = 0.05
# Checkpoint files: the manifest in each checkpoint directory, and the file naming the newest
# whole checkpoint (DeepSpeed's name, which its loader and zero_to_fp32.py read).
MANIFEST = "SHA256SUMS"
LATEST = "latest"
# A checkpoint is written under <tag>.saving and takes the tag's name once whole; an earlier
# checkpoint of that tag is moved to <tag>.replaced for the moment of the swap.
STAGING_SUFFIX = ".saving"
REPLACED_SUFFIX = ".replaced"
RUN_SHAPE = "run.json"  # in each checkpoint directory: what its files' number and shapes depend on
# Steps after a resume whose losses every rank checks together: a checkpoint with non-finite model
# weights fails at the first, one with non-finite optimizer state (fp32 master weights, moments)
# from the second on.
RESUME_FINITE_CHECK_STEPS = 5
# Defaults that --preset replaces; options given on the command line still win.
PRESETS = {
    # MoE-dominated: with 8 x 1024 windows per rank (configs/gpu_*.json) every MoE layer call gets
    # 8192 tokens per rank; the experts hold ~95 % of the weights and do ~75 % of the model FLOPs.
    "gpu": dict(
        layers=4,
        hidden=1024,
        ffn=4096,
        heads=16,
        seq_len=1024,
        experts=8,
        k=2,
        lr=1e-3,
        warmup=20,
        log_interval=10,
        timing_warmup=10,
    ),
    # Fine-grained experts (the MoE shape of Qwen1.5-MoE and DeepSeek-MoE: 64 experts of 1408, top-4).
    "gpu-fine": dict(
        layers=4,
        hidden=2048,
        ffn=1408,
        heads=16,
        seq_len=1024,
        experts=64,
        k=4,
        lr=1e-3,
        warmup=20,
        log_interval=10,
        timing_warmup=10,
    ),
}

# Hugging Face MoE models that --hf-model builds; each name is also the AutoEP preset that converts it.
HF_MODELS = ("mixtral", "qwen3_moe")

# --------------------------------------------------------------------------------------------
# Arguments and config
# --------------------------------------------------------------------------------------------


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_float(text):
    value = float(text)
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


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
        default=None,
        help="torch.distributed backend (default: DeepSpeed's for the accelerator); gloo lets "
        "ranks share a GPU (each rank's LOCAL_RANK names its GPU; scripts/shared_gpu_ranks.sh); "
        "with GPUs it needs the ranks in the environment (a launcher, or a one-node mpirun)",
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="a set of defaults: "
        + "; ".join(
            f"{name}: " + ", ".join(f"{key}={value}" for key, value in values.items())
            for name, values in PRESETS.items()
        ),
    )
    model = parser.add_argument_group("model")
    model.add_argument("--layers", type=positive_int, default=2, help="transformer blocks")
    model.add_argument("--hidden", type=positive_int, default=64, help="model width")
    model.add_argument("--ffn", type=positive_int, default=128, help="hidden size of each expert (and of dense FFNs)")
    model.add_argument("--heads", type=positive_int, default=4, help="attention heads")
    model.add_argument("--seq-len", type=positive_int, default=64, help="bytes per training window")
    model.add_argument(
        "--moe-every",
        type=positive_int,
        default=1,
        help="every N-th block has an MoE FFN (1: all blocks, 2: every other block), the rest dense",
    )
    model.add_argument("--gated", action="store_true", help="SwiGLU experts (GatedFeedForward) instead of GELU ones")
    model.add_argument(
        "--hf-model",
        choices=sorted(HF_MODELS),
        default=None,
        help="train this Hugging Face MoE model (random weights, the sizes above) under DeepSpeed "
        "AutoEP instead of the byte-level model; its experts are SwiGLU and drop no tokens, so "
        "--gated, --moe-every and the capacity options do not apply",
    )
    moe = parser.add_argument_group("mixture of experts")
    moe.add_argument(
        "--experts", type=positive_int, default=None, help="experts per MoE layer (default: 4 x world size)"
    )
    moe.add_argument("--ep-size", type=positive_int, default=None, help="expert-parallel size (default: world size)")
    moe.add_argument("--k", type=positive_int, default=2, help="experts per token (top-k)")
    moe.add_argument("--capacity-factor", type=float, default=1.25)
    moe.add_argument("--eval-capacity-factor", type=float, default=2.0)
    moe.add_argument("--min-capacity", type=non_negative_int, default=4)
    moe.add_argument(
        "--aux-coef",
        type=float,
        default=0.01,
        help="weight of the load-balancing loss (summed over the MoE layers; 1.0 each when balanced)",
    )
    train = parser.add_argument_group("training")
    train.add_argument(
        "--steps", type=positive_int, default=60, help="optimizer steps in all (a resumed run stops here too)"
    )
    train.add_argument("--lr", type=float, default=3e-3)
    train.add_argument("--weight-decay", type=float, default=0.01)
    train.add_argument("--warmup", type=non_negative_int, default=5, help="linear learning-rate warm-up steps")
    train.add_argument("--seed", type=int, default=1234)
    train.add_argument(
        "--corpus-mb", type=positive_float, default=4.0, help="MB of standard-library source to train on"
    )
    train.add_argument(
        "--eval-batches",
        type=non_negative_int,
        default=4,
        help="held-out batches per rank for the eval loss (0: no evaluation)",
    )
    train.add_argument("--log-interval", type=positive_int, default=10, help="print (and time) a window of N steps")
    train.add_argument(
        "--timing-warmup",
        type=non_negative_int,
        default=5,
        help="steps left out of the steady-state tokens/s (Summary/steady_tokens_per_s)",
    )
    train.add_argument(
        "--step-shares",
        action="store_true",
        help="time the MoE layers, the optimizer step and the rest of each timed step (device "
        "clock, rank 0) and print their shares at the end",
    )
    train.add_argument(
        "--monitor-dir",
        default=None,
        metavar="DIR",
        help="enable DeepSpeed's csv_monitor with its files in DIR (one CSV per tag; a resumed run appends)",
    )
    train.add_argument("--save-dir", default=None, help="checkpoint directory")
    train.add_argument(
        "--save-interval", type=non_negative_int, default=0, help="save every N steps (0: only at the end)"
    )
    train.add_argument("--save-at", type=int, nargs="+", default=[], metavar="STEP", help="also save after these steps")
    train.add_argument(
        "--no-final-save", action="store_true", help="do not save at the end, only at --save-interval / --save-at steps"
    )
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue from the checkpoint that --save-dir's 'latest' names (an error when there is none)",
    )
    train.add_argument(
        "--resume-tag",
        default=None,
        metavar="TAG",
        help="continue from checkpoint TAG in --save-dir (e.g. step20) instead of the latest",
    )
    train.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error", "critical"),
        default=None,
        help="level of DeepSpeed's logger (its default: warning); info also shows which pipeline "
        "the comet layers run and why",
    )
    deepspeed.add_config_arguments(parser)
    preset, _ = parser.parse_known_args(argv)
    if preset.preset:
        parser.set_defaults(**PRESETS[preset.preset])
    args = parser.parse_args(argv)
    if not args.deepspeed_config:
        parser.error("--deepspeed_config is required")
    if args.resume_tag:
        args.resume = True
    if args.resume and not args.save_dir:
        parser.error("--resume and --resume-tag need --save-dir")
    if args.hf_model and (args.gated or args.moe_every != 1):
        parser.error(
            "--gated and --moe-every describe the byte-level model; a --hf-model has SwiGLU experts in every block"
        )
    if args.hidden % args.heads:
        parser.error(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads})")
    return args


def read_ds_config(source):
    """The ds_config ``source`` names, read as DeepSpeed reads it: a path to an HJSON (or JSON) file,
    else a base64-encoded config; a key given twice in one object is an error. Exits with a message
    naming the source when it cannot be read."""
    try:
        if os.path.exists(source):
            with open(source) as handle:
                config = hjson.load(handle, object_pairs_hook=dict_raise_error_on_duplicate_keys)
        else:
            try:
                text = base64.urlsafe_b64decode(source).decode("utf-8")
            except (binascii.Error, UnicodeDecodeError):
                raise SystemExit(
                    f"--deepspeed_config {source}: no such file, and not a base64-encoded config"
                ) from None
            config = hjson.loads(text, object_pairs_hook=dict_raise_error_on_duplicate_keys)
    except (OSError, ValueError) as error:  # hjson's syntax errors and a duplicate key are ValueErrors
        raise SystemExit(f"--deepspeed_config {source}: {error}") from None
    if not isinstance(config, dict):
        raise SystemExit(f"--deepspeed_config {source}: holds a {type(config).__name__}, not a config object")
    return config


def load_ds_config(source, monitor_dir=None):
    """The ds_config (read_ds_config) as this example trains with it.

    On an accelerator it turns bf16 on unless the config enables bf16 or fp16 already; on CPU it
    trains in the config's precision. ``monitor_dir`` enables csv_monitor with its files directly
    in that directory (DeepSpeed writes them to output_path/job_name).
    """
    config = read_ds_config(source)
    if get_accelerator().device_name() != "cpu":
        enabled = lambda key: bool(config.get(key, {}).get("enabled", False))  # noqa: E731
        if not (enabled("bf16") or enabled("bfloat16") or enabled("fp16")):
            config["bf16"] = {"enabled": True}
    if monitor_dir:
        path = os.path.abspath(monitor_dir)
        config["csv_monitor"] = dict(
            config.get("csv_monitor") or {},
            enabled=True,
            output_path=os.path.dirname(path),
            job_name=os.path.basename(path),
        )
    return config


def local_world_size(world_size):
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        if os.environ.get(key):
            return int(os.environ[key])
    return world_size


# (rank, world size, local rank, local size) as MPI launchers name them: Open MPI, then MPICH/Hydra.
MPI_LAUNCHER_VARS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


def adopt_mpi_launcher_env(environ=os.environ):
    """Under a bare single-node mpirun, set the torch.distributed variables from the MPI launcher's own.

    DeepSpeed would otherwise discover the ranks through mpi4py and take the master address from the
    first word of ``hostname -I``, overriding a MASTER_ADDR passed with ``mpirun -x``; on a machine
    without a network interface that word does not exist. Here the ranks come from the launcher's
    environment, MASTER_ADDR stays what the caller set (127.0.0.1 if unset) and MASTER_PORT too.
    Multi-node jobs (local size < world size) are left to DeepSpeed's mpi4py discovery.
    Returns the variables it set.
    """
    if all(environ.get(key) for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return {}
    for rank_key, size_key, local_rank_key, local_size_key in MPI_LAUNCHER_VARS:
        values = [environ.get(key) for key in (rank_key, size_key, local_rank_key, local_size_key)]
        if not all(values):
            continue
        rank, size, local_rank, local_size = (int(value) for value in values)
        if local_size != size:
            return {}
        found = dict(
            RANK=str(rank),
            WORLD_SIZE=str(size),
            LOCAL_RANK=str(local_rank),
            LOCAL_WORLD_SIZE=str(size),
            MASTER_ADDR=environ.get("MASTER_ADDR") or "127.0.0.1",
            MASTER_PORT=environ.get("MASTER_PORT") or "29500",
        )
        environ.update(found)
        return found
    return {}


def usable_cpus():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def derived_seed(*parts):
    """A 63-bit seed from any tuple of values: the same parts give the same seed on every run."""
    digest = hashlib.sha256("/".join(str(part) for part in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


# --------------------------------------------------------------------------------------------
# Data: the standard library's source as bytes
# --------------------------------------------------------------------------------------------


def stdlib_corpus(max_bytes):
    """About ``max_bytes`` of the stdlib's *.py files, concatenated in order of relative path.

    Every n-th file of the sorted list is taken, n chosen so that the selection spans the whole
    library (asyncio to zoneinfo) instead of its first letters only; the held-out tail is then
    ordinary Python source rather than, say, the codec tables under encodings/.
    """
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in ("site-packages", "dist-packages", "__pycache__")]
        paths.extend(os.path.relpath(os.path.join(directory, name), root) for name in files if name.endswith(".py"))
    paths.sort()
    available = sum(os.path.getsize(os.path.join(root, rel)) for rel in paths)
    stride = max(1, available // max(1, max_bytes))
    chunks, total = [], 0
    for rel in paths[::stride]:
        with open(os.path.join(root, rel), "rb") as handle:
            data = handle.read()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    corpus = b"".join(chunks)[:max_bytes]
    if len(corpus) < 10_000:
        raise RuntimeError(f"found only {len(corpus)} bytes of Python source under {root}")
    return torch.frombuffer(bytearray(corpus), dtype=torch.uint8)


class Windows:
    """Random windows of ``seq_len + 1`` bytes, drawn from a generator seeded by (seed, rank, step)."""

    def __init__(self, data, seq_len, seed, rank):
        self.data, self.seq_len, self.seed, self.rank = data, seq_len, seed, rank
        self.offsets = torch.arange(seq_len + 1)

    def batch(self, batch_size, *key):
        generator = torch.Generator().manual_seed(derived_seed("data", self.seed, self.rank, *key))
        starts = torch.randint(0, self.data.numel() - self.seq_len - 1, (batch_size, 1), generator=generator)
        windows = self.data[starts + self.offsets].long()
        return windows[:, :-1], windows[:, 1:]


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x):
        batch, length, hidden = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, hidden // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, hidden))


class Block(nn.Module):
    def __init__(self, hidden, heads, ffn):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.ffn = ffn
        self.is_moe = isinstance(ffn, deepspeed.moe.layer.MoE)

    def forward(self, x):
        """(output, aux loss, per-expert token counts); the last two are None in a dense block."""
        x = x + self.attn(self.ln1(x))
        if self.is_moe:
            out, l_aux, exp_counts = self.ffn(self.ln2(x))
        else:
            out, l_aux, exp_counts = self.ffn(self.ln2(x)), None, None
        return x + out, l_aux, exp_counts


class ByteMoELM(nn.Module):
    def __init__(self, args, ds_config, num_experts, ep_size):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, args.hidden)
        self.pos = nn.Embedding(args.seq_len, args.hidden)
        expert_cls = ds_comet.experts.GatedFeedForward if args.gated else ds_comet.experts.FeedForward
        blocks = []
        for index in range(args.layers):
            if index % args.moe_every == 0:
                ffn = ds_comet.build_moe(
                    ds_config,
                    hidden_size=args.hidden,
                    expert=expert_cls(args.hidden, args.ffn),
                    num_experts=num_experts,
                    ep_size=ep_size,
                    k=args.k,
                    capacity_factor=args.capacity_factor,
                    eval_capacity_factor=args.eval_capacity_factor,
                    min_capacity=args.min_capacity,
                )
            else:
                ffn = expert_cls(args.hidden, args.ffn)
            blocks.append(Block(args.hidden, args.heads, ffn))
        self.blocks = nn.ModuleList(blocks)
        self.moe_blocks = [index for index, block in enumerate(blocks) if block.is_moe]
        self.num_experts = num_experts
        self.ln_f = nn.LayerNorm(args.hidden)
        self.head = nn.Linear(args.hidden, VOCAB)

    def forward(self, ids, targets):
        """(LM loss, summed aux loss, int64 [MoE blocks, experts] tokens each gate routed to each expert)."""
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok(ids) + self.pos(positions)
        aux = torch.zeros((), device=ids.device, dtype=torch.float32)
        counts = []
        for block in self.blocks:
            x, l_aux, exp_counts = block(x)
            if l_aux is not None:
                aux = aux + l_aux.float()
                counts.append(exp_counts.to(device=ids.device, dtype=torch.int64))
        logits = self.head(self.ln_f(x))
        lm_loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))
        return lm_loss, aux, torch.stack(counts)


def init_experts_(model, seed, rank, ep_size):
    """Distinct starting weights per expert, drawn from its global expert id.

    DeepSpeed builds a layer's local experts as deep copies of one module, so they would start
    identical. DeepSpeed lays expert-parallel groups out as consecutive ranks, so this rank's
    experts are ``(rank % ep_size) * num_local + i``; replicas of an expert (ranks ``ep_size``
    apart) draw the same weights, and DeepSpeed broadcasts them at initialize anyway.
    """
    ep_rank = rank % ep_size
    for layer_index, block in enumerate(model.blocks):
        if not block.is_moe:
            continue
        moe = block.ffn.deepspeed_moe
        for i, expert in enumerate(moe.experts.deepspeed_experts):
            global_id = ep_rank * moe.num_local_experts + i
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(derived_seed("expert", seed, layer_index, global_id))
                for module in expert.modules():
                    if isinstance(module, nn.Linear):
                        module.reset_parameters()


def hf_moe_model(args, num_experts):
    """The --hf-model causal LM over bytes with the example's sizes, its weights drawn from the config
    (the same on every rank under the same seed; AutoEP keeps each rank's share of the experts)."""
    try:
        import transformers
    except ImportError:
        raise SystemExit('--hf-model needs transformers (pip install "ds_comet[hf]")') from None
    common = dict(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.seq_len,
        num_experts_per_tok=args.k,
        use_cache=False,
    )
    if args.hf_model == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=num_experts, **common))
    if args.hf_model == "qwen3_moe":
        # Every block sparse (Qwen3-MoE's defaults: decoder_sparse_step 1, no mlp_only_layers), so
        # intermediate_size, the width of its dense MLPs, is not used.
        return transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(
                num_experts=num_experts,
                moe_intermediate_size=args.ffn,
                norm_topk_prob=True,
                head_dim=args.hidden // args.heads,
                **common,
            )
        )
    raise ValueError(f"no Hugging Face model {args.hf_model!r}; known: {', '.join(HF_MODELS)}")


def add_expert_parallel_section(ds_config, preset, ep_size, on_cpu):
    """Turns AutoEP on for a --hf-model: the "expert_parallel" section, unless the config has one
    (then it is the user's, kept as it is). torch._grouped_mm, AutoEP's grouped expert GEMM, needs
    a GPU; on CPU AutoEP runs its experts one by one. Returns the section the run uses."""
    if "expert_parallel" not in ds_config:
        ds_config["expert_parallel"] = {
            "enabled": True,
            "autoep_size": ep_size,
            "preset_model": preset,
            "use_grouped_mm": not on_cpu,
        }
    return ds_config["expert_parallel"]


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


class ByteLMForward:
    """The byte-level model's forward as the training loop calls it: ``(ids, targets) -> (LM loss, summed
    aux loss, int64 [MoE blocks, experts] tokens routed to each expert)``; ``moe_blocks`` names the MoE
    blocks' indices, ``num_experts`` the experts of each."""

    def __init__(self, engine, model):
        self.engine, self.moe_blocks, self.num_experts = engine, model.moe_blocks, model.num_experts

    def __call__(self, ids, targets):
        return self.engine(ids, targets)


class AutoEPCausalLMForward:
    """A Hugging Face causal LM under AutoEP (after initialization) behind ByteLMForward's interface."""

    def __init__(self, engine):
        from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer  # AutoEP's comet layer derives from it

        self.engine = engine
        layers = [(path, layer) for path, layer in engine.module.named_modules() if isinstance(layer, AutoEPMoELayer)]
        if not layers:
            raise RuntimeError(
                'AutoEP converted no MoE block of the model: the ds_config\'s "expert_parallel" '
                "section must enable it with the model's preset_model"
            )
        self.layers = [module for _, module in layers]
        self.moe_blocks = [int(re.search(r"layers\.(\d+)\.", path).group(1)) for path, _ in layers]
        self.num_experts = self.layers[0].num_experts

    def __call__(self, ids, targets):
        # The model's loss shifts `labels` itself (position t is scored against labels[t + 1]); the
        # targets are already each position's next byte, so they go in as `shift_labels`, which it
        # takes as they are: next-byte prediction at every position, as the byte-level model trains.
        # (Without `labels` the model computes no loss.)
        targets = targets.contiguous()  # the model views them flat
        output = self.engine(input_ids=ids, labels=targets, shift_labels=targets)
        counts = []
        with torch.no_grad():
            for layer in self.layers:
                # AutoEP adds every forward's routes (this rank's tokens, per global expert, none
                # dropped) to this float32 buffer, and nothing in DeepSpeed reads or resets it: taken
                # and zeroed at each call, the counts stay exact (float32 holds integers exactly up
                # to 2**24 only) however long the run.
                counts.append(layer.tokens_per_expert.to(torch.int64))
                layer.tokens_per_expert.zero_()
        aux = torch.zeros((), device=ids.device, dtype=torch.float32)
        return output.loss, aux, torch.stack(counts)


def moe_layer_classes(module):
    """{class name: count} of the MoE layers that run in ``module`` (stock's, AutoEP's, ds_comet's)."""
    from ds_comet.integrations.layer_classes import moe_layers

    found = {}
    for layer in moe_layers(module):
        found[type(layer).__name__] = found.get(type(layer).__name__, 0) + 1
    return found


# --------------------------------------------------------------------------------------------
# Checkpoints: whole before `latest` names them, checked against their manifest before a resume
# --------------------------------------------------------------------------------------------


class DiskFullError(OSError):
    """A checkpoint write that ran out of space; the message names the directory and its free space."""


def free_space(directory):
    """Free space of the filesystem that holds ``directory`` (or its nearest existing parent), as text."""
    path = os.path.abspath(directory)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    free = shutil.disk_usage(path).free
    for unit in ("B", "KiB", "MiB", "GiB"):
        if free < 1024 or unit == "GiB":
            return f"{free:.1f} {unit}" if unit != "B" else f"{free} B"
        free /= 1024


@contextlib.contextmanager
def explain_disk_full(directory, what):
    """Re-raises a write that failed for want of space as DiskFullError naming ``what`` was written,
    ``directory`` and the free space there.

    Recognised: OSError with ENOSPC or EDQUOT, and the RuntimeError "unexpected pos" of torch's zip
    writer, which is how torch.save reports a write that came up short. Other errors pass unchanged.
    """
    try:
        yield
    except DiskFullError:
        raise
    except (OSError, RuntimeError) as error:
        space = isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
        short_write = isinstance(error, RuntimeError) and "unexpected pos" in str(error)
        if not (space or short_write):
            raise
        raise DiskFullError(
            errno.ENOSPC,
            f"{what}: the disk is full: {free_space(directory)} free under "
            f"{directory} ({type(error).__name__}: {error})",
        ) from error


def file_sha256(path, flush_to_disk=False):
    """Hex sha256 of the file; with ``flush_to_disk``, also waits until its data is on the disk."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
        if flush_to_disk:
            os.fsync(handle.fileno())
    return digest.hexdigest()


def write_atomically(path, text):
    """Writes ``text`` to ``path`` so that a reader finds the old content or the new, never part of it."""
    temporary = path + ".tmp"
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself
    finally:
        os.close(directory)


def from_rank0(value):
    """Rank 0's ``value`` on every rank (collective)."""
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def on_rank0(step, what):
    """``step()`` run on rank 0 alone, its result on every rank (collective). If it raises, rank 0
    raises its exception and every other rank an error quoting it, rather than wait for rank 0 in
    the job's next collective."""
    outcome, raised = None, None
    if dist.get_rank() == 0:
        try:
            outcome = (True, step())
        except Exception as error:
            raised, outcome = error, (False, f"{type(error).__name__}: {error}")
    done, value = from_rank0(outcome)
    if raised is not None:
        raise raised
    if not done:
        raise RuntimeError(f"{what}: rank 0 failed: {value}")
    return value


def checkpoint_files(checkpoint_dir):
    """The files under ``checkpoint_dir``, as sorted paths relative to it, less the manifest and its temporary."""
    found = []
    for directory, _, files in os.walk(checkpoint_dir):
        for name in files:
            relative = os.path.relpath(os.path.join(directory, name), checkpoint_dir)
            if relative not in (MANIFEST, MANIFEST + ".tmp"):
                found.append(relative)
    return sorted(found)


def shared_sha256(checkpoint_dir, names, flush_to_disk=False):
    """({name: sha256}, {name: why it could not be read}) of ``names`` under ``checkpoint_dir``.

    Collective: each rank hashes every world-size-th file and every rank gets all results. Like
    DeepSpeed's loader, it assumes that every rank sees the whole checkpoint directory.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    digests, errors = {}, {}
    for name in names[rank::world_size]:
        try:
            digests[name] = file_sha256(os.path.join(checkpoint_dir, name), flush_to_disk)
        except FileNotFoundError:
            errors[name] = "missing"
        except OSError as error:
            errors[name] = f"cannot be read ({error})"
    gathered = [None] * world_size
    dist.all_gather_object(gathered, (digests, errors))
    return (
        {k: v for part, _ in gathered for k, v in part.items()},
        {k: v for _, part in gathered for k, v in part.items()},
    )


def run_shape(args, world_size, ep_size, num_experts):
    """What a checkpoint's parameter shapes and files depend on, by flag: a resume must match it."""
    shape = {
        "ranks": world_size,
        "--ep-size": ep_size,
        "--experts": num_experts,
        "--hf-model": args.hf_model,
        "--layers": args.layers,
        "--hidden": args.hidden,
        "--ffn": args.ffn,
        "--heads": args.heads,
        "--seq-len": args.seq_len,
    }
    if not args.hf_model:  # the byte-level model's own options (a Hugging Face model ignores them)
        shape.update({"--moe-every": args.moe_every, "--gated": args.gated})
    return shape


def shape_mismatch(save_dir, tag, shape):
    """How the run that saved checkpoint ``tag`` differs from ``shape`` (``run_shape``), in words, or
    None (also for a checkpoint saved without a record of its run). Collective."""
    saved = None
    if dist.get_rank() == 0:
        try:
            with open(os.path.join(save_dir, tag, RUN_SHAPE)) as handle:
                saved = json.load(handle)
        except FileNotFoundError:
            pass
    saved = from_rank0(saved)
    if saved is None:
        return None
    differing = [
        f"{key} {saved.get(key)} (this run: {value})" for key, value in shape.items() if saved.get(key) != value
    ]
    return ", ".join(differing) or None


def save_checkpoint(engine, save_dir, tag, client_state, shape):
    """Saves checkpoint ``tag`` with its manifest, and points ``latest`` at it once it is whole (collective).

    DeepSpeed's own ``latest`` (save_latest=True) is written by rank 0 as soon as rank 0 has written
    its files, while the other ranks may still be writing theirs; a rank that dies then leaves
    ``latest`` naming a checkpoint with a truncated file. Here DeepSpeed writes no ``latest``, and
    writes into a fresh directory ``<tag>.saving``: the barrier that ends engine.save_checkpoint
    means every rank has written its files; the ranks then hash them (and wait until they are on the
    disk), rank 0 writes the manifest, puts the directory in place of any earlier ``tag`` (whole
    until then: a save that fails leaves it as it was) and then writes ``latest``. ``shape`` (the
    run's ``run_shape``) is saved with the files, under the manifest. A full disk raises
    DiskFullError. Returns (files, bytes) of the checkpoint.
    """
    staging_dir, checkpoint_dir = os.path.join(save_dir, tag + STAGING_SUFFIX), os.path.join(save_dir, tag)

    def clear_staging():
        shutil.rmtree(staging_dir, ignore_errors=True)  # what an earlier save that failed left
        if os.path.lexists(staging_dir):
            raise OSError(f"{staging_dir}, left by an earlier save, cannot be removed: remove it")

    def list_files():
        write_atomically(os.path.join(staging_dir, RUN_SHAPE), json.dumps(shape, indent=1))
        return checkpoint_files(staging_dir)

    def put_in_place():
        listing = "".join(f"{digests[name]}  {name}\n" for name in names)
        write_atomically(os.path.join(staging_dir, MANIFEST), listing)
        replaced = checkpoint_dir + REPLACED_SUFFIX
        if os.path.isdir(checkpoint_dir):
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(checkpoint_dir, replaced)
        os.replace(staging_dir, checkpoint_dir)
        write_atomically(os.path.join(save_dir, LATEST), tag)  # also makes the renames durable
        shutil.rmtree(replaced, ignore_errors=True)
        return sum(os.path.getsize(os.path.join(checkpoint_dir, name)) for name in names)

    with explain_disk_full(save_dir, f"saving checkpoint {tag}"):
        on_rank0(clear_staging, f"saving checkpoint {tag}")
        engine.save_checkpoint(save_dir, tag=tag + STAGING_SUFFIX, client_state=client_state, save_latest=False)
        names = on_rank0(list_files, f"saving checkpoint {tag}")
        digests, errors = shared_sha256(staging_dir, names, flush_to_disk=True)
        if errors:
            raise RuntimeError(
                f"checkpoint {tag} in {save_dir}: saved files cannot be hashed: "
                + "; ".join(f"{name} {why}" for name, why in sorted(errors.items()))
            )
        size = on_rank0(put_in_place, f"saving checkpoint {tag}")
    return len(names), size


def read_latest(save_dir):
    """The tag that ``save_dir``'s ``latest`` names, or None when there is no such file (or it is empty)."""
    try:
        with open(os.path.join(save_dir, LATEST)) as handle:
            return handle.read().strip() or None
    except FileNotFoundError:
        return None


def read_manifest(checkpoint_dir):
    """{relative path: sha256} from the checkpoint's manifest; None when it has none.

    A malformed line raises ValueError.
    """
    try:
        with open(os.path.join(checkpoint_dir, MANIFEST)) as handle:
            lines = handle.read().splitlines()
    except FileNotFoundError:
        return None
    entries = {}
    for number, line in enumerate(lines, 1):
        match = re.fullmatch(r"([0-9a-f]{64}) [ *](.+)", line)
        if not match:
            raise ValueError(f"line {number} is not '<sha256>  <file>': {line[:80]!r}")
        entries[match.group(2)] = match.group(1)
    return entries


def checkpoint_to_resume(args):
    """The checkpoint tag that --resume / --resume-tag asks for; exits with the reason when there is none."""
    if not os.path.isdir(args.save_dir):
        raise SystemExit(f"error: cannot resume: no checkpoint in {args.save_dir}: the directory does not exist")
    tag = args.resume_tag or read_latest(args.save_dir)
    if tag is None:
        raise SystemExit(
            f"error: --resume: no checkpoint in {args.save_dir}: it has no '{LATEST}' file, which a "
            "save writes once the checkpoint is whole; start without --resume, or name a checkpoint "
            "with --resume-tag"
        )
    if not os.path.isdir(os.path.join(args.save_dir, tag)):
        present = sorted(name for name in os.listdir(args.save_dir) if os.path.isdir(os.path.join(args.save_dir, name)))
        hint = ""
        if tag + REPLACED_SUFFIX in present:  # a run stopped between a save's two renames
            hint = (
                f"; {tag + REPLACED_SUFFIX} is its earlier copy, which a save was replacing when the run "
                f"stopped: rename it to {tag} to resume from it"
            )
        raise SystemExit(
            f"error: cannot resume: no checkpoint {tag} in {args.save_dir} (there: "
            f"{', '.join(present) or 'none'}){hint}"
        )
    return tag


def checkpoint_problems(save_dir, tag):
    """What is wrong with checkpoint ``tag``: one message per damaged or missing file, or for a missing
    or unreadable manifest; empty when every file matches its sha256. Collective: every rank gets the list."""
    checkpoint_dir = os.path.join(save_dir, tag)
    found = None
    if dist.get_rank() == 0:
        try:
            manifest = read_manifest(checkpoint_dir)
            found = (
                manifest,
                None
                if manifest is not None
                else f"{tag} has no {MANIFEST}: its save did not finish, or another program wrote it",
            )
        except (OSError, ValueError) as error:
            found = (None, f"{tag}/{MANIFEST} cannot be read: {error}")
    manifest, problem = from_rank0(found)
    if problem:
        return [problem]
    names = sorted(manifest)
    digests, errors = shared_sha256(checkpoint_dir, names)
    problems = []
    for name in names:
        if name in errors:
            problems.append(f"{tag}/{name}: {errors[name]}")
        elif digests[name] != manifest[name]:
            problems.append(f"{tag}/{name}: damaged (its sha256 is not the one {tag}/{MANIFEST} recorded at the save)")
    return problems


def newest_intact_checkpoint(save_dir, skip):
    """The newest checkpoint in ``save_dir`` other than ``skip`` whose files all match its manifest, or
    None. Newest: the largest N of a ``step{N}`` tag, then the latest manifest. Collective."""
    candidates = None
    if dist.get_rank() == 0:
        ranked = []
        for name in os.listdir(save_dir):
            manifest = os.path.join(save_dir, name, MANIFEST)
            if name != skip and os.path.isfile(manifest):
                match = re.fullmatch(r"step(\d+)", name)
                ranked.append((int(match.group(1)) if match else -1, os.path.getmtime(manifest), name))
        candidates = [name for *_, name in sorted(ranked, reverse=True)]
    for tag in from_rank0(candidates):
        if not checkpoint_problems(save_dir, tag):
            return tag
    return None


def stop_all_ranks(message):
    """Ends the run on every rank, which all call it with the same message: rank 0 prints it, then all
    exit with status 1 together (a rank that left first could have a launcher kill rank 0 before it
    printed)."""
    if dist.get_rank() == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    dist.barrier()
    dist.destroy_process_group()
    raise SystemExit(1)


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def all_ranks_sum(values, device):
    """Sums over ranks of a list of floats (one all_reduce)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def all_ranks_values(values, device):
    """[rank 0's values, rank 1's values, ...] of a list of floats per rank (one all_reduce)."""
    tensor = torch.zeros(dist.get_world_size(), len(values), dtype=torch.float64, device=device)
    tensor[dist.get_rank()] = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor)
    return tensor.tolist()


def peak_memory_mib():
    """Most memory the accelerator's allocator held for tensors on this rank so far, in MiB; None on CPU
    (where DeepSpeed's accelerator reports the process's resident size at the moments it is asked)."""
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        return None
    return accelerator.max_memory_allocated() / 2**20


def evaluate(engine, forward, windows, batches, batch_size, device):
    engine.eval()
    total_lm = total_aux = 0.0
    with torch.no_grad():
        for index in range(batches):
            ids, targets = windows.batch(batch_size, "eval", index)
            torch.manual_seed(derived_seed("eval-noise", windows.seed, windows.rank, index))
            lm_loss, aux, _ = forward(ids.to(device), targets.to(device))
            total_lm += lm_loss.item()
            total_aux += aux.item()
    engine.train()
    lm, aux = all_ranks_sum([total_lm / batches, total_aux / batches], device)
    return lm / dist.get_world_size(), aux / dist.get_world_size()


def write_events(engine, events):
    """Hands [(tag, value, step)] (Python numbers) to DeepSpeed's monitor, on rank 0, when the ds_config enables one."""
    if engine.monitor.enabled and dist.get_rank() == 0:
        engine.monitor.write_events(events)


def main(argv=None):
    args = parse_args(argv)
    if args.log_level:
        set_log_level_from_string(args.log_level)
    ds_config = load_ds_config(args.deepspeed_config, args.monitor_dir)
    tag_to_resume = checkpoint_to_resume(args) if args.resume else None
    accelerator = get_accelerator()
    on_cpu = accelerator.device_name() == "cpu"

    # Rank discovery: the launcher's environment (deepspeed, torchrun); under a bare single-node
    # mpirun the MPI launcher's variables (see adopt_mpi_launcher_env), else DeepSpeed's mpi4py
    # discovery. A MASTER_PORT from the environment is honoured (DeepSpeed would otherwise use 29500).
    from_mpi = adopt_mpi_launcher_env()
    if not on_cpu and os.environ.get("LOCAL_RANK"):
        accelerator.set_device(int(os.environ["LOCAL_RANK"]))  # one device per rank before NCCL comes up
    if args.dist_backend == "gloo" and not on_cpu and os.environ.get("WORLD_SIZE"):
        # DeepSpeed would bind the rank's device to the default group, and torch then makes every new
        # group (the expert groups) by splitting it, which gloo cannot do; a group made here is kept.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        torch.distributed.init_process_group("gloo", timeout=default_pg_timeout)
    if on_cpu:
        # DeepSpeed's init_distributed would JIT-build its CPU comm op under torch's plain lock, which
        # an interrupted first launch leaves behind for every later run to wait on without a word.
        build_cpu_comm_op()
    deepspeed.init_distributed(
        dist_backend=args.dist_backend, distributed_port=int(os.environ.get("MASTER_PORT", 29500))
    )
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if on_cpu:
        torch.set_num_threads(max(1, usable_cpus() // local_world_size(world_size)))
    else:
        accelerator.set_device(local_rank)

    ep_size = args.ep_size or world_size
    num_experts = args.experts or 4 * world_size
    if world_size % ep_size or num_experts % ep_size:
        raise SystemExit(f"--ep-size {ep_size} must divide the world size ({world_size}) and --experts ({num_experts})")

    corpus = stdlib_corpus(int(args.corpus_mb * 2**20))
    split = int(corpus.numel() * (1 - EVAL_FRACTION))
    parts = {"training": split, **({"held-out": corpus.numel() - split} if args.eval_batches else {})}
    for part, size in parts.items():
        if size < args.seq_len + 2:  # a window and its next-byte target
            raise SystemExit(
                f"--corpus-mb {args.corpus_mb} gives a {part} part of {size} bytes, shorter than a "
                f"window of --seq-len {args.seq_len} (+2): raise --corpus-mb or lower --seq-len"
            )
    train_windows = Windows(corpus[:split], args.seq_len, args.seed, rank)
    eval_windows = Windows(corpus[split:], args.seq_len, args.seed, rank)

    torch.manual_seed(args.seed)  # dense weights: the same on every rank
    if args.hf_model:
        model = hf_moe_model(args, num_experts)
        ep_size = add_expert_parallel_section(ds_config, args.hf_model, ep_size, on_cpu).get("autoep_size", 1)
    else:
        model = ByteMoELM(args, ds_config, num_experts, ep_size)
        init_experts_(model, args.seed, rank, ep_size)
    shape = run_shape(args, world_size, ep_size, num_experts)

    warmup = max(1, args.warmup)
    # The scheduler, like the optimizer (moe_optimizer says why), is built by DeepSpeed once the
    # optimizer exists.
    scheduler = lambda optimizer: torch.optim.lr_scheduler.LambdaLR(  # noqa: E731
        optimizer, lambda step: min(1.0, (step + 1) / warmup)
    )
    # ds_comet.initialize: deepspeed.initialize (with AutoEP's conversion under "expert_parallel"), then
    # the MoE layers on the backend the config's "moe" section names.
    fused_adamw = accelerator.device_name() == "cuda"  # torch's fused AdamW runs on CUDA devices
    engine, _, _, _ = ds_comet.initialize(
        model=model,
        optimizer=moe_optimizer(args.lr, args.weight_decay, fused_adamw),
        lr_scheduler=scheduler,
        config=ds_config,
    )
    forward = AutoEPCausalLMForward(engine) if args.hf_model else ByteLMForward(engine, model)
    device = torch.device(engine.device)
    micro_batch = engine.train_micro_batch_size_per_gpu()
    grad_accum = engine.gradient_accumulation_steps()
    tokens_per_step = micro_batch * grad_accum * args.seq_len * world_size

    if args.save_dir and engine.checkpoint_engine.is_decoupled():
        # Such an engine writes after save_checkpoint returns: hashing then, and pointing `latest`
        # at the checkpoint, would vouch for files still being written.
        stop_all_ranks(
            "--save-dir: the ds_config's checkpoint engine writes in the background (decoupled); this "
            "example marks a checkpoint whole when save_checkpoint has returned on every rank, which "
            "needs a synchronous engine"
        )

    start_step = 0
    if tag_to_resume:
        problems = checkpoint_problems(args.save_dir, tag_to_resume)
        if problems:
            intact = newest_intact_checkpoint(args.save_dir, skip=tag_to_resume)
            advice = (
                f"the newest intact checkpoint is {intact}: resume from it with --resume-tag {intact}"
                if intact
                else f"no other checkpoint in {args.save_dir} is intact"
            )
            stop_all_ranks(
                f"checkpoint {tag_to_resume} in {args.save_dir} is damaged; not resuming from it:\n  "
                + "\n  ".join(problems)
                + f"\n{advice}"
            )
        mismatch = shape_mismatch(args.save_dir, tag_to_resume, shape)
        if mismatch:
            stop_all_ranks(
                f"checkpoint {tag_to_resume} in {args.save_dir} was saved by a run of another shape: "
                f"{mismatch}; resume with the flags and the number of ranks it was saved with"
            )
        load_path, client_state = engine.load_checkpoint(args.save_dir, tag=tag_to_resume)
        if load_path is None:
            stop_all_ranks(f"DeepSpeed did not load checkpoint {tag_to_resume} from {args.save_dir}")
        start_step = int(client_state["step"])
        if rank == 0:
            print(
                f"resumed from {load_path} at step {start_step} (its files match {tag_to_resume}/{MANIFEST})",
                flush=True,
            )

    saved = {"step": start_step if tag_to_resume else None}
    # Steady-state throughput: from the end of step `timing_from` to the end of the last step,
    # less the time spent saving checkpoints; a run too short for the warm-up is timed whole.
    timing_from = start_step + args.timing_warmup if args.steps - start_step > args.timing_warmup else start_step
    clock = {"start": None, "paused": 0.0}
    save_steps = set(args.save_at)

    def save(step):
        began = time.perf_counter()
        tag = f"step{step}"
        files, size = save_checkpoint(engine, args.save_dir, tag, {"step": step}, shape)
        saved["step"] = step
        if rank == 0:
            log(
                f"saved checkpoint {os.path.join(args.save_dir, tag)}: {files} files, {size / 2**20:.1f} MiB, "
                f"sha256 in {MANIFEST}; {LATEST} -> {tag}"
            )
        return time.perf_counter() - began

    backend = ds_comet.moe_config_from(ds_config).backend
    dtype = next(engine.module.parameters()).dtype
    params = sum(p.numel() for p in engine.module.parameters())
    layer_classes = ", ".join(f"{count} x {name}" for name, count in moe_layer_classes(engine.module).items())
    if rank == 0:
        if from_mpi:
            print(
                f"ranks from the MPI launcher's environment (MASTER_ADDR {from_mpi['MASTER_ADDR']}, "
                f"MASTER_PORT {from_mpi['MASTER_PORT']})",
                flush=True,
            )
        print(
            f"model {args.hf_model or 'byte-level'} | world size {world_size} | ep size {ep_size} | "
            f"experts {num_experts} | k {args.k} | backend {backend} | moe layers {layer_classes or 'none'} | "
            f"params on rank 0 {params} | micro batch {micro_batch} | grad accum {grad_accum} | dtype "
            f"{dtype} | device {device}",
            flush=True,
        )
        if engine.monitor.csv_monitor is not None:
            print(f"csv_monitor writes to {engine.monitor.csv_monitor.log_dir}", flush=True)
    write_events(
        engine,
        [
            (f"Run/{name}", value, start_step)
            for name, value in (
                ("start_step", start_step),
                ("world_size", world_size),
                ("zero_stage", engine.zero_optimization_stage()),
                ("tokens_per_step", tokens_per_step),
                ("params_rank0", params),
            )
        ],
    )
    show_bar = rank == 0 and sys.stderr.isatty()
    bar = tqdm(total=args.steps, initial=start_step, disable=not show_bar, dynamic_ncols=True)

    def log(line):
        if show_bar:
            bar.write(line)
        else:
            print(line, flush=True)

    shares = ds_comet.step_shares.StepShares(engine.module, device) if args.step_shares else None
    window = []  # (step, lm loss, aux loss, lr) of this rank since the last log line
    window_counts = None  # tokens each gate routed to each expert since the last log line
    last_loss = None
    engine.train()
    accelerator.synchronize()
    train_start = time.perf_counter()
    if timing_from == start_step:
        clock["start"] = train_start
    window_start = train_start
    for step in range(start_step + 1, args.steps + 1):
        step_lm = step_aux = 0.0
        lr = engine.get_lr()[0]  # the rate this step's update uses (the scheduler steps inside engine.step)
        measured = shares.step(measure=step > timing_from) if shares else contextlib.nullcontext()
        with measured:
            for micro in range(grad_accum):
                ids, targets = train_windows.batch(micro_batch, step, micro)
                # The gate's random draws (top-2 sampling, random token selection) depend on the step
                # alone, so a resumed run takes the same ones as an uninterrupted run.
                torch.manual_seed(derived_seed("noise", args.seed, rank, step, micro))
                lm_loss, aux, counts = forward(ids.to(device), targets.to(device))
                engine.backward(lm_loss + args.aux_coef * aux)
                with shares.optimizer() if shares else contextlib.nullcontext():
                    engine.step()
                step_lm += lm_loss.item() / grad_accum
                step_aux += aux.item() / grad_accum
                window_counts = counts if window_counts is None else window_counts + counts
        window.append((step, step_lm, step_aux, lr))
        bar.update(1)

        if tag_to_resume and step <= start_step + RESUME_FINITE_CHECK_STEPS:
            per_rank = all_ranks_values([step_lm, step_aux], device)
            bad = [
                (r, lm, aux) for r, (lm, aux) in enumerate(per_rank) if not (math.isfinite(lm) and math.isfinite(aux))
            ]
            if bad:
                ranks = "; ".join(f"rank {r}: loss {lm}, aux {aux}" for r, lm, aux in bad)
                stop_all_ranks(
                    f"step {step}: the loss is not finite ({ranks}), {step - start_step} step(s) after "
                    f"resuming from checkpoint {tag_to_resume} in {args.save_dir}; that checkpoint does "
                    "not train: resume from an earlier one with --resume-tag, or start afresh"
                )

        if step % args.log_interval == 0 or step == args.steps:
            # One all_reduce for the window: every step's loss and aux, and the expert counts.
            losses = [value for _, lm, aux, _ in window for value in (lm, aux)]
            sums = all_ranks_sum(losses + window_counts.flatten().tolist(), device)
            means = [value / world_size for value in sums[: len(losses)]]
            expert_tokens = [round(value) for value in sums[len(losses) :]]
            accelerator.synchronize()
            tokens_per_s = len(window) * tokens_per_step / (time.perf_counter() - window_start)
            if shares is not None:
                shares.read()  # the window's timestamps into the totals (their events freed)
            lm, aux = sum(means[0::2]) / len(window), sum(means[1::2]) / len(window)
            last_loss = means[-2]
            events = []
            for index, (logged_step, _, _, logged_lr) in enumerate(window):
                events += [
                    ("Train/Steps/loss", means[2 * index], logged_step),
                    ("Train/Steps/aux_loss", means[2 * index + 1], logged_step),
                    ("Train/Steps/lr", logged_lr, logged_step),
                ]
            events.append(("Train/Steps/tokens_per_s", tokens_per_s, step))
            for position, block in enumerate(forward.moe_blocks):
                for expert in range(forward.num_experts):
                    events.append(
                        (
                            f"Train/Steps/expert_tokens/layer{block}_expert{expert}",
                            expert_tokens[position * forward.num_experts + expert],
                            step,
                        )
                    )
            write_events(engine, events)
            if rank == 0:
                log(f"step {step} | loss {lm:.4f} | aux {aux:.4f} | tokens/s {tokens_per_s:.0f}")
                bar.set_postfix(loss=f"{lm:.3f}")
            window, window_counts = [], None
            window_start = time.perf_counter()

        if args.save_dir and ((args.save_interval and step % args.save_interval == 0) or step in save_steps):
            seconds = save(step)
            window_start += seconds
            if clock["start"] is not None:
                clock["paused"] += seconds

        if step == timing_from:
            accelerator.synchronize()
            clock["start"], clock["paused"] = time.perf_counter(), 0.0

    accelerator.synchronize()
    train_seconds = time.perf_counter() - train_start
    timed_steps = args.steps - timing_from
    steady_tokens_per_s = step_ms = None
    if clock["start"] is not None and timed_steps > 0:
        seconds = time.perf_counter() - clock["start"] - clock["paused"]
        steady_tokens_per_s = timed_steps * tokens_per_step / seconds
        step_ms = 1000 * seconds / timed_steps
    peak = peak_memory_mib()
    peaks = [row[0] for row in all_ranks_values([peak], device)] if peak is not None else None
    bar.close()

    final_step = max(start_step, args.steps)
    if args.save_dir and not args.no_final_save and saved["step"] != final_step:
        save(final_step)

    summary = [("train_seconds", train_seconds), ("timed_steps", max(timed_steps, 0))]
    if last_loss is not None:
        summary.append(("final_loss", last_loss))
    if steady_tokens_per_s is not None:
        summary += [("steady_tokens_per_s", steady_tokens_per_s), ("step_ms", step_ms)]
    if peaks is not None:
        summary.append(("peak_memory_mib", max(peaks)))
    if shares is not None:
        totals = shares.read()
        shares.remove()
        if totals.steps:
            summary += [
                (name, value)
                for name, value in totals.per_step().items()
                if name.endswith(("_ms", "_share")) and name != "step_ms"
            ]
    if rank == 0:
        if last_loss is not None:
            print(f"final loss {last_loss:.4f}", flush=True)
        if steady_tokens_per_s is not None:
            print(
                f"throughput {steady_tokens_per_s:.0f} tokens/s over steps {timing_from + 1}-{args.steps} "
                f"({step_ms:.1f} ms/step, {tokens_per_step} tokens/step)",
                flush=True,
            )
        if peaks is not None:
            print(
                f"peak memory {max(peaks):.0f} MiB (max over ranks; per rank {', '.join(f'{p:.0f}' for p in peaks)})",
                flush=True,
            )
        if shares is not None:
            print(f"{totals.describe()} (rank 0)", flush=True)

    if args.eval_batches > 0:
        eval_lm, eval_aux = evaluate(engine, forward, eval_windows, args.eval_batches, micro_batch, device)
        summary += [("eval_loss", eval_lm), ("eval_aux_loss", eval_aux)]
        if rank == 0:
            print(f"eval loss {eval_lm:.4f} (ppl {math.exp(eval_lm):.2f}, aux {eval_aux:.4f})", flush=True)
    write_events(engine, [(f"Summary/{name}", value, final_step) for name, value in summary])
    # Leave together: a rank that exits while another still uses the process group (rank 0 hosts
    # its store) makes the other's NCCL heartbeat monitor complain.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
