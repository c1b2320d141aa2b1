"""The models examples/train_moe.py trains, and the bytes they train on.

- ``ByteMoELM``: a decoder-only transformer over raw bytes (vocabulary 256) whose feed-forward
  blocks are MoE layers built with ``ds_comet.build_moe`` (the ds_config's ``"moe"`` section picks
  the comet backend or stock DeepSpeed's);
- ``hf_moe_model``: a Hugging Face ``MixtralForCausalLM`` or ``Qwen3MoeForCausalLM`` of the same
  sizes with random weights (no download), for DeepSpeed AutoEP to convert;
- ``ByteLMForward`` and ``AutoEPCausalLMForward``: either model's forward as the training loop
  calls it, ``(ids, targets) -> (LM loss, aux loss, int64 [MoE blocks, experts] routed tokens)``;
- ``stdlib_corpus`` and ``Windows``: the Python standard library's own source, as random windows of
  bytes drawn from (seed, rank, step), so that a resumed run sees the data an uninterrupted one does.
"""

import hashlib
import os
import re
import sysconfig

import deepspeed
import torch
from torch import nn
from torch.nn import functional as F

import ds_comet
import ds_comet.experts

VOCAB = 256
# Hugging Face MoE models that hf_moe_model builds; each name is also the AutoEP preset that converts it.
HF_MODELS = ("mixtral", "qwen3_moe")


def derived_seed(*parts):
    """A 63-bit seed from any tuple of values: the same parts give the same seed on every run."""
    digest = hashlib.sha256("/".join(str(part) for part in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


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
            chunks.append(handle.read())
        total += len(chunks[-1])
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
            ffn = expert_cls(args.hidden, args.ffn)
            if index % args.moe_every == 0:
                ffn = ds_comet.build_moe(
                    ds_config,
                    hidden_size=args.hidden,
                    expert=ffn,
                    num_experts=num_experts,
                    ep_size=ep_size,
                    k=args.k,
                    capacity_factor=args.capacity_factor,
                    eval_capacity_factor=args.eval_capacity_factor,
                    min_capacity=args.min_capacity,
                )
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
    for layer_index, block in enumerate(model.blocks):
        if not block.is_moe:
            continue
        moe = block.ffn.deepspeed_moe
        for i, expert in enumerate(moe.experts.deepspeed_experts):
            global_id = (rank % ep_size) * moe.num_local_experts + i
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(derived_seed("expert", seed, layer_index, global_id))
                for module in expert.modules():
                    if isinstance(module, nn.Linear):
                        module.reset_parameters()


class ByteLMForward:
    """The byte-level model's forward as the training loop calls it: ``(ids, targets) -> (LM loss, summed
    aux loss, int64 [MoE blocks, experts] tokens routed to each expert)``; ``moe_blocks`` names the MoE
    blocks' indices, ``num_experts`` the experts of each."""

    def __init__(self, engine, model):
        self.engine, self.moe_blocks, self.num_experts = engine, model.moe_blocks, model.num_experts

    def __call__(self, ids, targets):
        return self.engine(ids, targets)


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
        qwen = dict(moe_intermediate_size=args.ffn, norm_topk_prob=True, head_dim=args.hidden // args.heads)
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(num_experts=num_experts, **qwen, **common))
    raise ValueError(f"no Hugging Face model {args.hf_model!r}; known: {', '.join(HF_MODELS)}")


def add_expert_parallel_section(ds_config, preset, ep_size, on_cpu):
    """Turns AutoEP on for a --hf-model: the "expert_parallel" section, unless the config has one
    (then it is the user's, kept as it is). torch._grouped_mm, AutoEP's grouped expert GEMM, needs
    a GPU; on CPU AutoEP runs its experts one by one. Returns the section the run uses."""
    if "expert_parallel" not in ds_config:
        section = dict(enabled=True, autoep_size=ep_size, preset_model=preset, use_grouped_mm=not on_cpu)
        ds_config["expert_parallel"] = section
    return ds_config["expert_parallel"]


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
