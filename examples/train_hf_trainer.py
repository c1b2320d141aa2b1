"""Train a tiny Hugging Face MoE model with the Hugging Face Trainer on DeepSpeed, with ds_comet.

The only line ds_comet adds to a Trainer script is ``import ds_comet``; the ds_config decides the
rest: ``"expert_parallel"`` makes DeepSpeed's AutoEP replace the model's MoE blocks, and
``"moe": {"backend": "comet"}`` runs them on ds_comet (``"deepspeed"`` or no ``"moe"`` section: AutoEP
alone). The model has random weights from its config and learns bytes of the Python standard
library's sources: nothing is downloaded.

    deepspeed --num_gpus 2 --master_port 29563 examples/train_hf_trainer.py \\
        --deepspeed configs/hf_trainer_zero2_comet.json --max-steps 40

``torchrun --nproc_per_node 2`` and ``accelerate launch --use_deepspeed --num_processes 2`` start it
too. What AutoEP itself needs under the Trainer, with or without ds_comet: an ``"optimizer"``
section in the ds_config (the Trainer builds its own optimizer before AutoEP replaces the MoE
blocks, and DeepSpeed refuses that one: it has no MoE parameter groups), and, on a machine without
GPUs, ``use_cpu=True`` (the Trainer runs DeepSpeed on CPU only then; the script sets it there, and
trains in fp32; on GPUs in bf16). ``configs/hf_trainer_zero3_comet.json`` runs ZeRO stage 3. ``--losses
FILE`` writes each logged loss as a JSON line.
"""

import argparse
import contextlib
import json
import os
import sys

import torch
import transformers

import ds_comet  # the one line: DeepSpeed's engine then honours the "moe" section
import ds_comet.launch  # only for --dist-backend

VOCAB = 256  # bytes


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deepspeed", required=True, help="the ds_config (JSON)")
    parser.add_argument("--model", choices=("mixtral", "qwen3_moe"), default="mixtral")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank and step")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--output-dir", default="runs/hf_trainer")
    parser.add_argument("--losses", help="write each logged loss to this file, one JSON line a step")
    parser.add_argument(
        "--dist-backend",
        choices=("nccl", "gloo"),
        help="the process group's backend (default: DeepSpeed's choice); gloo lets ranks share a GPU "
        "(scripts/shared_gpu_ranks.sh), which NCCL refuses",
    )
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # the deepspeed launcher's
    return parser.parse_args(argv)


def tiny_model(name: str, seed: int) -> transformers.PreTrainedModel:
    """A two-layer MoE model of ``name``'s family with random weights (the same on every rank)."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    if name == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=256, num_local_experts=8, num_experts_per_tok=2, **common)
        return transformers.MixtralForCausalLM(config)
    config = transformers.Qwen3MoeConfig(
        intermediate_size=256, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2, head_dim=32, **common
    )
    return transformers.Qwen3MoeForCausalLM(config)


class StdlibBytes(torch.utils.data.Dataset):
    """Windows of ``seq_len`` bytes of the standard library's Python sources, the same on every rank."""

    def __init__(self, seq_len: int, windows: int, seed: int):
        corpus = bytearray()
        root = os.path.dirname(os.__file__)
        for name in sorted(os.listdir(root)):
            if name.endswith(".py") and len(corpus) < 2**21:
                with open(os.path.join(root, name), "rb") as handle:
                    corpus += handle.read()
        data = torch.tensor(list(corpus), dtype=torch.long)
        starts = torch.randint(0, len(data) - seq_len, (windows,), generator=torch.Generator().manual_seed(seed))
        self.windows = torch.stack([data[s : s + seq_len] for s in starts.tolist()])

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, index):
        ids = self.windows[index]
        return {"input_ids": ids, "labels": ids}


class LossFile(transformers.TrainerCallback):
    """Each logged training loss as a JSON line {"step": ..., "loss": ...}, written by the first rank."""

    def __init__(self, path: str):
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            with open(self.path, "a") as handle:
                handle.write(json.dumps({"step": state.global_step, "loss": logs["loss"]}) + "\n")


def main(argv=None):
    args = parse_args(argv)
    if args.dist_backend is not None:
        # Accelerate starts DeepSpeed's process group on the accelerator's backend, whatever
        # TrainingArguments(ddp_backend=) says; a group already started is the one it keeps.
        ds_comet.launch.init_distributed(args.dist_backend)
    model = tiny_model(args.model, args.seed)
    data = StdlibBytes(args.seq_len, args.max_steps * args.batch_size * 8, args.seed)
    training = transformers.TrainingArguments(
        output_dir=args.output_dir,
        deepspeed=args.deepspeed,
        use_cpu=not torch.cuda.is_available(),  # the Trainer runs DeepSpeed on CPU only when told so
        bf16=torch.cuda.is_available(),  # the fused kernels run bf16 tokens
        per_device_train_batch_size=args.batch_size,
        max_steps=args.max_steps,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        data_seed=args.seed,
        dataloader_drop_last=True,
        disable_tqdm=True,
    )
    if args.losses:
        with contextlib.suppress(FileNotFoundError):  # every rank removes it; one of them first
            os.remove(args.losses)
    callbacks = [LossFile(args.losses)] if args.losses else []
    trainer = transformers.Trainer(model=model, args=training, train_dataset=data, callbacks=callbacks)
    trainer.train()
    if torch.distributed.is_initialized():
        # The ranks end their process groups together, before the interpreter's teardown. A CPU run's
        # rank has been seen to abort at exit after training ("terminate called without an active
        # exception"); this narrows the window in which one rank's teardown meets a peer still using
        # the group, but the cause is not known.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
