# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Train a model with zero-element parameters under ZeRO-3, save a checkpoint and load it back.

Run on two CPU ranks with the DeepSpeed launcher:

    deepspeed --num_accelerators 2 examples/zero3_empty_params/train.py

The model has the shapes that upstream DeepSpeed 0.19.8 fails on at the first forward
(``AssertionError: {'id': ..., 'status': 'NOT_AVAILABLE', 'numel': 0, ...}``): a classifier head
with zero labels whose output is in the loss, and an adapter at rank 0 next to a sized layer.
"""

import argparse
import os

import torch
import torch.nn as nn

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator


class LowRankAdapter(nn.Module):
    """A LoRA-style adapter; at rank 0 its weight has no elements and it adds nothing."""

    def __init__(self, hidden, rank):
        super().__init__()
        self.down = nn.Linear(hidden, rank, bias=False)

    def forward(self, x):
        return self.down(x).sum(dim=-1, keepdim=True)


class Model(nn.Module):

    def __init__(self, hidden=16, num_labels=0, adapter_rank=0):
        super().__init__()
        self.body = nn.Linear(hidden, hidden)
        self.adapter = LowRankAdapter(hidden, adapter_rank)
        self.head = nn.Linear(hidden, num_labels, bias=False)  # zero labels: a (0, hidden) weight
        self.out = nn.Linear(hidden, 1)

    def forward(self, x, y):
        h = torch.relu(self.body(x)) + self.adapter(x)
        loss = nn.functional.mse_loss(self.out(h).squeeze(-1), y)
        # The empty head's output is part of the loss, as a classifier's would be.
        return loss + self.head(h).sum()


def make_engine(args):
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-2,
                "torch_adam": True
            }
        },
        "zero_optimization": {
            "stage": 3
        },
        "steps_per_print": 1000,
    }
    if args.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    torch.manual_seed(0)
    model = Model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def batches(engine, steps, hidden=16, dataset_batches=4):
    """Cycle over a small fixed data set (a different one per rank), so that the loss goes down."""
    generator = torch.Generator().manual_seed(1234 + dist.get_rank())
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    dataset = [torch.randn(4, hidden, generator=generator) for _ in range(dataset_batches)]
    for step in range(steps):
        x = dataset[step % dataset_batches]
        yield x.to(engine.device, dtype), x.sum(dim=-1).to(engine.device, dtype)


def full_state(engine):
    """The full (gathered) parameters, by name, for comparing two engines."""
    state = {}
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            state[name] = param.detach().clone().float().cpu()
    return state


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--save_dir", default=os.path.join("build", "example-checkpoint"))
    parser.add_argument("--local_rank", type=int, default=0, help="set by the launcher")
    args = parser.parse_args()

    deepspeed.init_distributed()
    engine = make_engine(args)
    for step, (x, y) in enumerate(batches(engine, args.steps)):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        if dist.get_rank() == 0 and step % 5 == 4:
            print(f"step {step + 1}: loss {loss.item():.4f}", flush=True)
    engine.save_checkpoint(args.save_dir, tag="example")
    saved = full_state(engine)

    # A fresh engine, loaded from the checkpoint, must hold the same model, empty parameters included.
    restored = make_engine(args)
    restored.load_checkpoint(args.save_dir, tag="example")
    loaded = full_state(restored)
    assert saved.keys() == loaded.keys(), (saved.keys(), loaded.keys())
    for name in saved:
        assert saved[name].shape == loaded[name].shape, (name, saved[name].shape, loaded[name].shape)
        assert torch.equal(saved[name], loaded[name]), name
    # and it trains on from there.
    x, y = next(batches(restored, 1))
    loss = restored(x, y)
    restored.backward(loss)
    restored.step()
    dist.barrier()
    if dist.get_rank() == 0:
        shapes = {name: tuple(t.shape) for name, t in loaded.items()}
        print(f"checkpoint {args.save_dir}/example reloaded on {dist.get_world_size()} ranks "
              f"({get_accelerator().device_name()}): {shapes}")
        print("OK", flush=True)
    # Shut the process group down before the interpreter does: left to exit, a rank can abort in
    # teardown ("terminate called without an active exception") after it has finished.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
