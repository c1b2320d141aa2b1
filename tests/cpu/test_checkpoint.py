"""Checkpoints move between the stock and the comet backend both ways, under ZeRO-1 and ZeRO-2.

Expert parallelism spans every rank of the pool, with two experts per rank.
"""

import os

import deepspeed
import pytest
import torch
from deepspeed import comm as dist
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from torch import nn

import ds_comet
from ds_comet.experts import FeedForward

HIDDEN, FFN, EXPERTS_PER_RANK = 16, 24, 2


class Net(nn.Module):
    def __init__(self, ds_config):
        super().__init__()
        self.inp = nn.Linear(HIDDEN, HIDDEN)
        ep_size = dist.get_world_size()
        self.moe = ds_comet.build_moe(
            ds_config,
            hidden_size=HIDDEN,
            expert=FeedForward(HIDDEN, FFN),
            num_experts=EXPERTS_PER_RANK * ep_size,
            ep_size=ep_size,
            k=2,
        )
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        hidden, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
        return self.out(hidden), l_aux


def make_engine(backend, zero_stage, init_seed):
    ds_config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
        "moe": {"backend": backend, "overlap": "none"},
    }
    torch.manual_seed(init_seed)
    model = Net(ds_config)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "dense"})
    optimizer = torch.optim.AdamW(groups, lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    return engine


def train(engine, first_step, steps):
    losses = []
    for step in range(first_step, first_step + steps):
        generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        x = torch.randn(4, 8, HIDDEN, generator=generator)
        target = torch.randn(4, 8, HIDDEN, generator=generator)
        torch.manual_seed(step)  # the gate's top-2 sampling noise
        output, l_aux = engine(x)
        loss = ((output - target) ** 2).mean() + 0.01 * l_aux
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def snapshot(engine):
    return {name: value.detach().clone() for name, value in engine.module.state_dict().items()}


def interop_case(save_dir, first, second, zero_stage):
    engine = make_engine(first, zero_stage, init_seed=1)
    train(engine, 0, 3)
    engine.save_checkpoint(save_dir, tag="step3")
    saved = snapshot(engine)
    expected_losses = train(engine, 3, 3)
    expected_state = snapshot(engine)

    other = make_engine(second, zero_stage, init_seed=2)  # other weights, so loading must do the work
    other.load_checkpoint(save_dir, tag="step3")
    loaded = snapshot(other)
    assert loaded.keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), f"{name} differs after loading a {first} checkpoint into {second}"
    losses = train(other, 3, 3)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=1e-6)
    for name, value in snapshot(other).items():
        torch.testing.assert_close(value, expected_state[name], rtol=1e-5, atol=1e-6, msg=name)
    return sorted(os.listdir(os.path.join(save_dir, "step3")))


@pytest.mark.parametrize("zero_stage", [1, 2])
@pytest.mark.parametrize("first,second", [("deepspeed", "comet"), ("comet", "deepspeed")])
def test_checkpoint_interop(cpu_pool, tmp_path, first, second, zero_stage):
    files = cpu_pool.run(interop_case, save_dir=str(tmp_path), first=first, second=second, zero_stage=zero_stage)[0]
    # Stock DeepSpeed's layout: one file per expert, the expert keys in stock form.
    for expert in range(EXPERTS_PER_RANK * cpu_pool.world_size):
        assert f"layer_0_expert_{expert}_mp_rank_00_model_states.pt" in files
    expert_file = torch.load(tmp_path / "step3" / "layer_0_expert_0_mp_rank_00_model_states.pt", weights_only=False)
    assert all(".deepspeed_moe.experts.deepspeed_experts.0." in key for key in expert_file)
