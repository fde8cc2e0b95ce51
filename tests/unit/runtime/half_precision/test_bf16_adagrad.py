# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A bf16 job with ``torch.optim.Adagrad`` saves and resumes its checkpoints. Covered: the two
optimizers that train bf16 weights through fp32 copies of them, the BF16 optimizer (ZeRO-1 with fp32
gradient accumulation) and, without ZeRO, the unfused one; each with the Hugging Face Trainer's two
parameter groups and an LR scheduler built on the client optimizer, as the Trainer builds it. The
optimizer holds states for the fp32 copies only, the scheduler sets the learning rates of the groups
it steps, and the steps after a resume have the losses of the run that saved the checkpoint and went
on training uninterrupted.

On deepspeed 0.19.8 Adagrad, which creates its states at construction, kept those of the bf16
weights after the optimizer replaced them with their fp32 copies: every save failed with a
``KeyError`` in ``torch.optim.Optimizer.state_dict()``.
"""

import pytest
import torch

import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import groups

from unit.common import DistributedTest
from unit.checkpoint.autotp_common import (LR, build_model, ds_config, param_group_hyperparameters, train_engine,
                                           trainer_param_groups)

SAVE_STEPS = 2
RESUME_STEPS = 2


def initialize(stage):
    groups._release_process_group_references(None)
    model = build_model(dtype=torch.bfloat16)
    config = ds_config(stage, tp_size=1, dtype=torch.bfloat16)
    del config["optimizer"]
    config["zero_allow_untested_optimizer"] = True
    if stage == 1:
        # ZeRO-1 runs the BF16 optimizer for bf16 weights with fp32 gradient accumulation.
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    optimizer = torch.optim.Adagrad(trainer_param_groups(model, no_decay_lr=LR / 2), lr=LR)
    # As the Hugging Face Trainer hands its schedule over: built on the client optimizer.
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           config=config,
                                           optimizer=optimizer,
                                           lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda _: 0.5))
    return engine


class TestBF16Adagrad(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("stage,optimizer_class", [(0, "FP16_UnfusedOptimizer"), (1, "BF16_Optimizer")])
    def test_save_and_resume(self, stage, optimizer_class, tmpdir):
        if not get_accelerator().is_bf16_supported():
            pytest.skip("bf16 is not supported on this accelerator")
        engine = initialize(stage)
        assert type(engine.optimizer).__name__ == optimizer_class
        hyperparameters = param_group_hyperparameters(engine)
        # The schedule halves each group's own learning rate.
        assert [(group["lr"], group["weight_decay"]) for group in hyperparameters] == [(LR / 2, 0.1), (LR / 4, 0.0)]
        losses = train_engine(engine, 1, SAVE_STEPS)
        engine.save_checkpoint(str(tmpdir), tag="step2")
        optimized = {param for group in engine.optimizer.optimizer.param_groups for param in group["params"]}
        others = [param for param in engine.optimizer.optimizer.state if param not in optimized]
        assert not others, f"Adagrad holds states of {len(others)} tensors that it does not optimize"
        losses += train_engine(engine, 1, RESUME_STEPS, first_step=SAVE_STEPS)
        engine.destroy()

        engine = initialize(stage)
        load_path, _ = engine.load_checkpoint(str(tmpdir), tag="step2")
        assert load_path is not None
        assert param_group_hyperparameters(engine) == hyperparameters
        resumed = train_engine(engine, 1, RESUME_STEPS, first_step=SAVE_STEPS)
        assert resumed == pytest.approx(losses[SAVE_STEPS:], rel=1e-6)
        engine.destroy()
