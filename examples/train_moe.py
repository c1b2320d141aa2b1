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

``--metrics-file`` gets JSON lines: a ``start`` record (backend, ZeRO stage, dtype, sizes), one
record per step (loss and aux averaged over the ranks), a ``train_end`` record (final loss,
steady-state tokens/s after ``--timing-warmup`` steps, peak memory) and an ``eval`` record.
"""

import argparse
import hashlib
import json
import logging
import math
import os
import sys
import sysconfig
import time

import deepspeed
import torch
from deepspeed import comm as dist
from deepspeed.constants import default_pg_timeout
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from torch import nn
from torch.nn import functional as F
from tqdm import tqdm

import ds_comet
import ds_comet.experts

VOCAB = 256
EVAL_FRACTION = 0.05
# Defaults that --preset replaces; options given on the command line still win.
PRESETS = {
    # MoE-dominated: with 8 x 1024 windows per rank (configs/gpu_*.json) every MoE layer call gets
    # 8192 tokens per rank; the experts hold ~95 % of the weights and do ~75 % of the model FLOPs.
    "gpu": dict(layers=4, hidden=1024, ffn=4096, heads=16, seq_len=1024, experts=8, k=2, lr=1e-3, warmup=20,
                log_interval=10, timing_warmup=10),
    # Fine-grained experts (the MoE shape of Qwen1.5-MoE and DeepSeek-MoE: 64 experts of 1408, top-4).
    "gpu-fine": dict(layers=4, hidden=2048, ffn=1408, heads=16, seq_len=1024, experts=64, k=4, lr=1e-3, warmup=20,
                     log_interval=10, timing_warmup=10),
}

# --------------------------------------------------------------------------------------------
# Arguments and config
# --------------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", "--local-rank", type=int, default=-1,
                        help="set by the deepspeed launcher; the script reads LOCAL_RANK from the environment")
    parser.add_argument("--dist-backend", choices=("nccl", "gloo"), default=None,
                        help="torch.distributed backend (default: DeepSpeed's for the accelerator); gloo lets "
                             "ranks share a GPU (each rank's LOCAL_RANK names its GPU; scripts/shared_gpu_ranks.sh); "
                             "with GPUs it needs the ranks in the environment (a launcher, or a one-node mpirun)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="a set of defaults: " + "; ".join(
                            f"{name}: " + ", ".join(f"{key}={value}" for key, value in values.items())
                            for name, values in PRESETS.items()))
    model = parser.add_argument_group("model")
    model.add_argument("--layers", type=int, default=2, help="transformer blocks")
    model.add_argument("--hidden", type=int, default=64, help="model width")
    model.add_argument("--ffn", type=int, default=128, help="hidden size of each expert (and of dense FFNs)")
    model.add_argument("--heads", type=int, default=4, help="attention heads")
    model.add_argument("--seq-len", type=int, default=64, help="bytes per training window")
    model.add_argument("--moe-every", type=int, default=1,
                       help="every N-th block has an MoE FFN (1: all blocks, 2: every other block), the rest dense")
    model.add_argument("--gated", action="store_true", help="SwiGLU experts (GatedFeedForward) instead of GELU ones")
    moe = parser.add_argument_group("mixture of experts")
    moe.add_argument("--experts", type=int, default=None, help="experts per MoE layer (default: 4 x world size)")
    moe.add_argument("--ep-size", type=int, default=None, help="expert-parallel size (default: world size)")
    moe.add_argument("--k", type=int, default=2, help="experts per token (top-k)")
    moe.add_argument("--capacity-factor", type=float, default=1.25)
    moe.add_argument("--eval-capacity-factor", type=float, default=2.0)
    moe.add_argument("--min-capacity", type=int, default=4)
    moe.add_argument("--aux-coef", type=float, default=0.01,
                     help="weight of the load-balancing loss (summed over the MoE layers; 1.0 each when balanced)")
    train = parser.add_argument_group("training")
    train.add_argument("--steps", type=int, default=60, help="optimizer steps in all (a resumed run stops here too)")
    train.add_argument("--lr", type=float, default=3e-3)
    train.add_argument("--weight-decay", type=float, default=0.01)
    train.add_argument("--warmup", type=int, default=5, help="linear learning-rate warm-up steps")
    train.add_argument("--seed", type=int, default=1234)
    train.add_argument("--corpus-mb", type=float, default=4.0, help="MB of standard-library source to train on")
    train.add_argument("--eval-batches", type=int, default=4,
                       help="held-out batches per rank for the eval loss (0: no evaluation)")
    train.add_argument("--log-interval", type=int, default=10, help="print (and time) a window of N steps")
    train.add_argument("--timing-warmup", type=int, default=5,
                       help="steps left out of the steady-state tokens/s of the train_end record")
    train.add_argument("--metrics-file", default=None,
                       help="rank 0 writes JSON lines here: one per step and a summary (appended to when resuming)")
    train.add_argument("--save-dir", default=None, help="checkpoint directory")
    train.add_argument("--save-interval", type=int, default=0, help="save every N steps (0: only at the end)")
    train.add_argument("--save-at", type=int, nargs="+", default=[], metavar="STEP", help="also save after these steps")
    train.add_argument("--no-final-save", action="store_true",
                       help="do not save at the end, only at --save-interval / --save-at steps")
    train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save-dir")
    train.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default=None,
                       help="level of DeepSpeed's logger (its default: warning); info also shows which pipeline "
                       "the comet layers run and why")
    deepspeed.add_config_arguments(parser)
    preset, _ = parser.parse_known_args(argv)
    if preset.preset:
        parser.set_defaults(**PRESETS[preset.preset])
    args = parser.parse_args(argv)
    if not args.deepspeed_config:
        parser.error("--deepspeed_config is required")
    if args.resume and not args.save_dir:
        parser.error("--resume needs --save-dir")
    if args.hidden % args.heads:
        parser.error(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads})")
    return args


def load_ds_config(path):
    with open(path) as handle:
        config = json.load(handle)
    if torch.cuda.is_available():
        enabled = lambda key: bool(config.get(key, {}).get("enabled", False))  # noqa: E731
        if not (enabled("bf16") or enabled("bfloat16") or enabled("fp16")):
            config["bf16"] = {"enabled": True}
    return config


def local_world_size(world_size):
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        if os.environ.get(key):
            return int(os.environ[key])
    return world_size


# (rank, world size, local rank, local size) as MPI launchers name them: Open MPI, then MPICH/Hydra.
MPI_LAUNCHER_VARS = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                      "OMPI_COMM_WORLD_LOCAL_SIZE"),
                     ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"))


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
        found = dict(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(size),
                     MASTER_ADDR=environ.get("MASTER_ADDR") or "127.0.0.1",
                     MASTER_PORT=environ.get("MASTER_PORT") or "29500")
        environ.update(found)
        return found
    return {}


def set_deepspeed_log_level(name):
    """DeepSpeed's logger, which ds_comet logs through too, and its handlers at ``name``."""
    level = getattr(logging, name.upper())
    ds_logger = logging.getLogger("DeepSpeed")
    ds_logger.setLevel(level)
    for handler in ds_logger.handlers:
        handler.setLevel(level)


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
        x = x + self.attn(self.ln1(x))
        if self.is_moe:
            out, l_aux, _exp_counts = self.ffn(self.ln2(x))
        else:
            out, l_aux = self.ffn(self.ln2(x)), None
        return x + out, l_aux


class ByteMoELM(nn.Module):

    def __init__(self, args, ds_config, num_experts, ep_size):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, args.hidden)
        self.pos = nn.Embedding(args.seq_len, args.hidden)
        expert_cls = ds_comet.experts.GatedFeedForward if args.gated else ds_comet.experts.FeedForward
        blocks = []
        for index in range(args.layers):
            if index % args.moe_every == 0:
                ffn = ds_comet.build_moe(ds_config,
                                         hidden_size=args.hidden,
                                         expert=expert_cls(args.hidden, args.ffn),
                                         num_experts=num_experts,
                                         ep_size=ep_size,
                                         k=args.k,
                                         capacity_factor=args.capacity_factor,
                                         eval_capacity_factor=args.eval_capacity_factor,
                                         min_capacity=args.min_capacity)
            else:
                ffn = expert_cls(args.hidden, args.ffn)
            blocks.append(Block(args.hidden, args.heads, ffn))
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(args.hidden)
        self.head = nn.Linear(args.hidden, VOCAB)

    def forward(self, ids, targets):
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok(ids) + self.pos(positions)
        aux = torch.zeros((), device=ids.device, dtype=torch.float32)
        for block in self.blocks:
            x, l_aux = block(x)
            if l_aux is not None:
                aux = aux + l_aux.float()
        logits = self.head(self.ln_f(x))
        lm_loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))
        return lm_loss, aux


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


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def all_ranks_mean(values, device):
    """Mean over ranks of a list of floats (one all_reduce)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return (tensor / dist.get_world_size()).tolist()


def all_ranks_values(value, device):
    """[rank 0's value, rank 1's value, ...] of one float per rank (one all_reduce)."""
    tensor = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=device)
    tensor[dist.get_rank()] = value
    dist.all_reduce(tensor)
    return tensor.tolist()


def synchronize(device):
    """Wait for the work queued on the device, so that a clock read afterwards covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_mib(device):
    """Most memory torch's allocator held for tensors on this rank's GPU so far, in MiB; None on CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**20


def evaluate(engine, windows, batches, batch_size, device):
    engine.eval()
    total_lm = total_aux = 0.0
    with torch.no_grad():
        for index in range(batches):
            ids, targets = windows.batch(batch_size, "eval", index)
            torch.manual_seed(derived_seed("eval-noise", windows.seed, windows.rank, index))
            lm_loss, aux = engine(ids.to(device), targets.to(device))
            total_lm += lm_loss.item()
            total_aux += aux.item()
    engine.train()
    lm, aux = all_ranks_mean([total_lm / batches, total_aux / batches], device)
    return lm, aux


def main(argv=None):
    args = parse_args(argv)
    if args.log_level:
        set_deepspeed_log_level(args.log_level)
    ds_config = load_ds_config(args.deepspeed_config)

    # Rank discovery: the launcher's environment (deepspeed, torchrun); under a bare single-node
    # mpirun the MPI launcher's variables (see adopt_mpi_launcher_env), else DeepSpeed's mpi4py
    # discovery. A MASTER_PORT from the environment is honoured (DeepSpeed would otherwise use 29500).
    from_mpi = adopt_mpi_launcher_env()
    if torch.cuda.is_available() and os.environ.get("LOCAL_RANK"):
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # one GPU per rank before NCCL comes up
    if args.dist_backend == "gloo" and torch.cuda.is_available() and os.environ.get("WORLD_SIZE"):
        # DeepSpeed would bind the rank's GPU to the default group, and torch then makes every new
        # group (the expert groups) by splitting it, which gloo cannot do; a group made here is kept.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        torch.distributed.init_process_group("gloo", timeout=default_pg_timeout)
    deepspeed.init_distributed(dist_backend=args.dist_backend,
                               distributed_port=int(os.environ.get("MASTER_PORT", 29500)))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    else:
        torch.set_num_threads(max(1, usable_cpus() // local_world_size(world_size)))

    ep_size = args.ep_size or world_size
    num_experts = args.experts or 4 * world_size
    if world_size % ep_size or num_experts % ep_size:
        raise SystemExit(f"--ep-size {ep_size} must divide the world size ({world_size}) and --experts ({num_experts})")

    corpus = stdlib_corpus(int(args.corpus_mb * 2**20))
    split = int(corpus.numel() * (1 - EVAL_FRACTION))
    train_windows = Windows(corpus[:split], args.seq_len, args.seed, rank)
    eval_windows = Windows(corpus[split:], args.seq_len, args.seed, rank)

    torch.manual_seed(args.seed)  # dense weights: the same on every rank
    model = ByteMoELM(args, ds_config, num_experts, ep_size)
    init_experts_(model, args.seed, rank, ep_size)

    param_groups = split_params_into_different_moe_groups_for_optimizer({
        "params": list(model.parameters()),
        "name": "dense",
    })
    optimizer = torch.optim.AdamW(param_groups, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    warmup = max(1, args.warmup)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=ds_config)
    device = torch.device(engine.device)
    micro_batch = engine.train_micro_batch_size_per_gpu()
    grad_accum = engine.gradient_accumulation_steps()
    tokens_per_step = micro_batch * grad_accum * args.seq_len * world_size

    start_step = 0
    if args.resume:
        load_path, client_state = engine.load_checkpoint(args.save_dir)
        if load_path is None:
            if rank == 0:
                print(f"no checkpoint in {args.save_dir}; starting from step 0", flush=True)
        else:
            start_step = int(client_state["step"])
            if rank == 0:
                print(f"resumed from {load_path} at step {start_step}", flush=True)

    saved = {"step": start_step if args.resume else None}
    # Steady-state throughput: from the end of step `timing_from` to the end of the last step,
    # less the time spent saving checkpoints; a run too short for the warm-up is timed whole.
    timing_from = start_step + args.timing_warmup if args.steps - start_step > args.timing_warmup else start_step
    clock = {"start": None, "paused": 0.0}
    save_steps = set(args.save_at)

    def save(step):
        began = time.perf_counter()
        engine.save_checkpoint(args.save_dir, tag=f"step{step}", client_state={"step": step})
        saved["step"] = step
        return time.perf_counter() - began

    backend = ds_comet.moe_config_from(ds_config).backend
    dtype = next(engine.module.parameters()).dtype
    metrics = None

    def record(**fields):
        if metrics:
            metrics.write(json.dumps(fields) + "\n")
            metrics.flush()

    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        if from_mpi:
            print(f"ranks from the MPI launcher's environment (MASTER_ADDR {from_mpi['MASTER_ADDR']}, "
                  f"MASTER_PORT {from_mpi['MASTER_PORT']})", flush=True)
        print(f"world size {world_size} | ep size {ep_size} | experts {num_experts} | k {args.k} | "
              f"backend {backend} | params on rank 0 {params} | "
              f"micro batch {micro_batch} | grad accum {grad_accum} | dtype "
              f"{dtype} | device {device}", flush=True)
        if args.metrics_file:
            metrics = open(args.metrics_file, "a" if args.resume and start_step else "w")
        record(event="start", backend=backend, zero_stage=engine.zero_optimization_stage(),
               dtype=str(dtype).replace("torch.", ""), device=device.type, world_size=world_size, ep_size=ep_size,
               experts=num_experts, k=args.k, layers=args.layers, hidden=args.hidden, ffn=args.ffn,
               seq_len=args.seq_len, micro_batch=micro_batch, grad_accum=grad_accum, tokens_per_step=tokens_per_step,
               params_rank0=params, seed=args.seed, start_step=start_step, steps=args.steps,
               ds_config=os.path.basename(args.deepspeed_config))
    show_bar = rank == 0 and sys.stderr.isatty()
    bar = tqdm(total=args.steps, initial=start_step, disable=not show_bar, dynamic_ncols=True)

    def log(line):
        if show_bar:
            bar.write(line)
        else:
            print(line, flush=True)

    window = []  # (step, lm loss, aux loss, lr) of this rank since the last log line
    last_loss = None
    engine.train()
    synchronize(device)
    train_start = time.perf_counter()
    if timing_from == start_step:
        clock["start"] = train_start
    window_start = train_start
    for step in range(start_step + 1, args.steps + 1):
        step_lm = step_aux = 0.0
        lr = engine.get_lr()[0]  # the rate this step's update uses (the scheduler steps inside engine.step)
        for micro in range(grad_accum):
            ids, targets = train_windows.batch(micro_batch, step, micro)
            # The gate's random draws (top-2 sampling, random token selection) depend on the step
            # alone, so a resumed run takes the same ones as an uninterrupted run.
            torch.manual_seed(derived_seed("noise", args.seed, rank, step, micro))
            lm_loss, aux = engine(ids.to(device), targets.to(device))
            engine.backward(lm_loss + args.aux_coef * aux)
            engine.step()
            step_lm += lm_loss.item() / grad_accum
            step_aux += aux.item() / grad_accum
        window.append((step, step_lm, step_aux, lr))
        bar.update(1)

        if step % args.log_interval == 0 or step == args.steps:
            # One all_reduce for the window: every step's loss and aux, averaged over the ranks.
            means = all_ranks_mean([value for _, lm, aux, _ in window for value in (lm, aux)], device)
            synchronize(device)
            tokens_per_s = len(window) * tokens_per_step / (time.perf_counter() - window_start)
            lm, aux = sum(means[0::2]) / len(window), sum(means[1::2]) / len(window)
            last_loss = means[-2]
            for index, (logged_step, _, _, lr) in enumerate(window):
                fields = dict(step=logged_step, loss=means[2 * index], aux=means[2 * index + 1], lr=lr)
                if logged_step == step:
                    fields["tokens_per_s"] = tokens_per_s
                record(**fields)
            if rank == 0:
                log(f"step {step} | loss {lm:.4f} | aux {aux:.4f} | tokens/s {tokens_per_s:.0f}")
                bar.set_postfix(loss=f"{lm:.3f}")
            window = []
            window_start = time.perf_counter()

        if args.save_dir and ((args.save_interval and step % args.save_interval == 0) or step in save_steps):
            seconds = save(step)
            window_start += seconds
            if clock["start"] is not None:
                clock["paused"] += seconds

        if step == timing_from:
            synchronize(device)
            clock["start"], clock["paused"] = time.perf_counter(), 0.0

    synchronize(device)
    train_seconds = time.perf_counter() - train_start
    timed_steps = args.steps - timing_from
    steady_tokens_per_s = step_ms = None
    if clock["start"] is not None and timed_steps > 0:
        seconds = time.perf_counter() - clock["start"] - clock["paused"]
        steady_tokens_per_s = timed_steps * tokens_per_step / seconds
        step_ms = 1000 * seconds / timed_steps
    peak = peak_memory_mib(device)
    peaks = all_ranks_values(peak or 0.0, device) if peak is not None else None
    bar.close()

    final_step = max(start_step, args.steps)
    if args.save_dir and not args.no_final_save and saved["step"] != final_step:
        save(final_step)

    if rank == 0:
        if last_loss is not None:
            print(f"final loss {last_loss:.4f}", flush=True)
        if steady_tokens_per_s is not None:
            print(f"throughput {steady_tokens_per_s:.0f} tokens/s over steps {timing_from + 1}-{args.steps} "
                  f"({step_ms:.1f} ms/step, {tokens_per_step} tokens/step)", flush=True)
        if peaks is not None:
            print(f"peak memory {max(peaks):.0f} MiB (max over ranks; per rank "
                  f"{', '.join(f'{p:.0f}' for p in peaks)})", flush=True)
        record(event="train_end", step=final_step, final_loss=last_loss, steady_tokens_per_s=steady_tokens_per_s,
               step_ms=step_ms, timed_steps=max(timed_steps, 0), timing_from=timing_from,
               peak_mem_mib=max(peaks) if peaks else None, peak_mem_mib_per_rank=peaks, train_seconds=train_seconds)

    if args.eval_batches > 0:
        eval_lm, eval_aux = evaluate(engine, eval_windows, args.eval_batches, micro_batch, device)
        if rank == 0:
            print(f"eval loss {eval_lm:.4f} (ppl {math.exp(eval_lm):.2f}, aux {eval_aux:.4f})", flush=True)
            record(event="eval", step=final_step, final_loss=last_loss, eval_loss=eval_lm, eval_aux=eval_aux)
    if metrics:
        metrics.close()
    # Leave together: a rank that exits while another still uses the process group (rank 0 hosts
    # its store) makes the other's NCCL heartbeat monitor complain.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
