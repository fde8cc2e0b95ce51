# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Hugging Face accelerate with a DeepSpeed ZeRO config, on the CPU: a small regression model trained
for ``--steps`` steps with torch's AdamW, saving its state (``accelerator.save_state``, a DeepSpeed
checkpoint of tag ``pytorch_model`` plus accelerate's own files) every ``--save_every`` steps, and
resumed from one with ``--resume`` (``accelerator.load_state``), on any number of ranks. Run it under
``torch.distributed.run``:

    python -m torch.distributed.run --nproc_per_node 2 train.py --output_dir out --stage 3 --steps 2
    python -m torch.distributed.run --nproc_per_node 1 train.py --output_dir out --stage 3 --steps 4 \\
        --resume out/step2

Each step's batch is the same whatever the number of ranks (each rank takes its share of it), so a
resumed run's losses and final weights are those of an uninterrupted one. The script prints
``step N loss X`` for each step and ``parameter checksum S`` at the end.

``--total_limit L`` names the checkpoints as accelerate does by itself (``out/checkpoints/checkpoint_<i>``,
``ProjectConfiguration(automatic_checkpoint_naming=True)``) and keeps the last L of them;
``--async_save`` writes them in the background (``"checkpoint": {"async_save": true}``);
``--end_training`` calls ``accelerator.end_training()`` (which destroys the process group) right
after the last save and exits.
"""

import argparse
import os

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DeepSpeedPlugin, ProjectConfiguration

import deepspeed

GLOBAL_BATCH = 8


class TrainingProgress:
    """The number of steps trained, saved with the state (``accelerator.register_for_checkpointing``)."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def global_batch(step):
    """The batch of the step-th step (from 1), the same whatever the number of ranks."""
    x = torch.randn(GLOBAL_BATCH, 16, generator=torch.Generator().manual_seed(step))
    return x, x.sum(1, keepdim=True)


def rank_batch(accelerator, step):
    """This rank's share of the step's batch."""
    return [t.chunk(accelerator.num_processes)[accelerator.process_index] for t in global_batch(step)]


def step_loss(accelerator, model, step):
    """The loss of this rank's share of the step's batch, and its mean over the ranks."""
    x, y = rank_batch(accelerator, step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    return loss, accelerator.reduce(loss.detach(), reduction="mean").item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--stage", type=int, default=2, help="the ZeRO stage")
    parser.add_argument("--steps", type=int, default=4, help="train until this many steps are done")
    parser.add_argument("--save_every", type=int, default=2, help="save the state every this many steps")
    parser.add_argument("--total_limit",
                        type=int,
                        default=None,
                        help="name the saves as accelerate does (checkpoints/checkpoint_<i>) and keep this many "
                        "(default: save to <output_dir>/step<N>, keep all)")
    parser.add_argument("--resume", default=None, help="the saved state to resume from (default: start afresh)")
    parser.add_argument("--async_save", action="store_true", help="save the checkpoints in the background")
    parser.add_argument("--end_training",
                        action="store_true",
                        help="call accelerator.end_training() right after the last save, then exit")
    args = parser.parse_args()

    # accelerate runs DeepSpeed on CUDA devices only: on a machine without them, Accelerator(cpu=True)
    # leaves DeepSpeed out (MULTI_CPU), and Accelerator() alone makes each rank a job of its own. So, as
    # the Hugging Face Trainer does with TrainingArguments(use_cpu=True, deepspeed=...), the process
    # group is set up first, on the CPU with gloo; the Accelerator below then finds it, and its
    # DeepSpeed plugin turns the state into DeepSpeed's (accelerator.distributed_type DEEPSPEED).
    state = PartialState(cpu=True, backend="gloo")

    config = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // state.num_processes,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": args.stage
        },
    }
    if args.async_save:
        config["checkpoint"] = {"async_save": True}
    if args.total_limit is None:
        project_config = ProjectConfiguration(project_dir=args.output_dir)
    else:
        project_config = ProjectConfiguration(project_dir=args.output_dir,
                                              automatic_checkpoint_naming=True,
                                              total_limit=args.total_limit)
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), project_config=project_config)
    accelerator.print(f"distributed type {accelerator.distributed_type.value}, world size {accelerator.num_processes}",
                      flush=True)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    progress = TrainingProgress()
    accelerator.register_for_checkpointing(progress)

    if args.resume is not None:
        accelerator.load_state(args.resume)
        with torch.no_grad():
            _, loss = step_loss(accelerator, model, progress.step + 1)
        accelerator.print(f"resumed at step {progress.step}, loss of next step {loss!r}", flush=True)

    while progress.step < args.steps:
        loss, mean_loss = step_loss(accelerator, model, progress.step + 1)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        progress.step += 1
        accelerator.print(f"step {progress.step} loss {mean_loss!r}", flush=True)
        if progress.step % args.save_every == 0:
            if args.total_limit is None:
                accelerator.save_state(os.path.join(args.output_dir, f"step{progress.step}"))
            else:
                accelerator.save_state()

    if args.end_training:
        accelerator.end_training()
        return

    params = list(accelerator.unwrap_model(model).parameters())
    with deepspeed.zero.GatheredParameters(params):
        checksum = sum(param.detach().double().abs().sum().item() for param in params)
    accelerator.print(f"parameter checksum {checksum!r}", flush=True)


if __name__ == "__main__":
    main()
