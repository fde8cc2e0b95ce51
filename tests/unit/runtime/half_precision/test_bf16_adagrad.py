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

from unit.common import DistributedTest

LR = 1e-2
SAVE_STEPS = 2
RESUME_STEPS = 2


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(1234)
    return LlamaForCausalLM(
        LlamaConfig(vocab_size=128,
                    hidden_size=64,
                    intermediate_size=128,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    max_position_embeddings=16)).to(torch.bfloat16)


def initialize(stage):
    model = build_model()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {
            "stage": stage
        },
        "bf16": {
            "enabled": True
        },
        "zero_allow_untested_optimizer": True,
    }
    if stage == 1:
        # ZeRO-1 runs the BF16 optimizer for bf16 weights with fp32 gradient accumulation.
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    # The Hugging Face Trainer's groups (weight decay on matrices, none on norm weights), the second one
    # with a learning rate of its own.
    optimizer = torch.optim.Adagrad([{
        "params": [param for param in model.parameters() if param.dim() >= 2],
        "weight_decay": 0.1
    }, {
        "params": [param for param in model.parameters() if param.dim() < 2],
        "weight_decay": 0.0,
        "lr": LR / 2
    }],
                                    lr=LR)
    # As the Trainer hands its schedule over: built on the client optimizer.
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           config=config,
                                           optimizer=optimizer,
                                           lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda _: 0.5))
    return engine


def hyperparameters(engine):
    return [{
        key: value
        for key, value in group.items() if key != "params"
    } for group in engine.optimizer.optimizer.param_groups]


def train(engine, first_step, steps):
    losses = []
    for step in range(first_step, first_step + steps):
        ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(step)).to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


class TestBF16Adagrad(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("stage,optimizer_class", [(0, "FP16_UnfusedOptimizer"), (1, "BF16_Optimizer")])
    def test_save_and_resume(self, stage, optimizer_class, tmpdir):
        if not get_accelerator().is_bf16_supported():
            pytest.skip("bf16 is not supported on this accelerator")
        engine = initialize(stage)
        assert type(engine.optimizer).__name__ == optimizer_class
        saved = hyperparameters(engine)
        # The schedule halves each group's own learning rate.
        assert [(group["lr"], group["weight_decay"]) for group in saved] == [(LR / 2, 0.1), (LR / 4, 0.0)]
        train(engine, 0, SAVE_STEPS)
        engine.save_checkpoint(str(tmpdir), tag="step2")
        optimized = {param for group in engine.optimizer.optimizer.param_groups for param in group["params"]}
        others = [param for param in engine.optimizer.optimizer.state if param not in optimized]
        assert not others, f"Adagrad holds states of {len(others)} tensors that it does not optimize"
        uninterrupted = train(engine, SAVE_STEPS, RESUME_STEPS)
        engine.destroy()

        engine = initialize(stage)
        load_path, _ = engine.load_checkpoint(str(tmpdir), tag="step2")
        assert load_path is not None
        assert hyperparameters(engine) == saved
        assert train(engine, SAVE_STEPS, RESUME_STEPS) == pytest.approx(uninterrupted, rel=1e-6)
        engine.destroy()
