# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A universal checkpoint restores each optimizer parameter group's own hyperparameters. The model
is trained with the two groups the Hugging Face Trainer builds (weight decay on matrices, none on
norm weights), the second one with a lower learning rate, saved, converted with ``ds_to_universal``
and restored with ``load_universal``: every group holds the hyperparameters it was saved with, and
the next steps' losses are those of the run that went on uninterrupted, as after a load of the
checkpoint itself at the same size.

On deepspeed 0.19.8 the ZeRO-3 universal loader gives every group the hyperparameters of the first
one: the norm weights are decayed from then on, at the matrices' learning rate.
"""

import os
from types import SimpleNamespace

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.checkpoint import UNIVERSAL_CHECKPOINT_INFO
from deepspeed.checkpoint.ds_to_universal import main as convert_to_universal

from unit.common import DistributedTest

LR = 1e-2
SAVE_STEPS = 2
RESUME_STEPS = 2
TAG = "step2"


def initialize(stage, dtype, load_universal=False, one_group=False):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(1234)
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=128,
                    hidden_size=64,
                    intermediate_size=128,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    max_position_embeddings=16)).to(dtype)
    # The groups the Hugging Face Trainer builds, the second one with a learning rate of its own.
    param_groups = list(
        model.parameters()) if one_group else [{
            "params": [param for param in model.parameters() if param.dim() >= 2],
            "weight_decay": 0.1
        }, {
            "params": [param for param in model.parameters() if param.dim() < 2],
            "weight_decay": 0.0,
            "lr": LR / 2
        }]
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": LR,
                "torch_adam": True
            }
        },
        "zero_optimization": {
            "stage": stage
        },
        "bf16": {
            "enabled": dtype == torch.bfloat16
        },
        "checkpoint": {
            "load_universal": load_universal
        },
    }
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=param_groups)
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


class TestUniversalCheckpointParamGroups(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("stage,dtype", [(1, torch.float32), (2, torch.float32), (3, torch.float32),
                                             (3, torch.bfloat16)])
    def test_param_groups(self, stage, dtype, tmpdir):
        folder = str(tmpdir)
        engine = initialize(stage, dtype)
        train(engine, 0, SAVE_STEPS)
        engine.save_checkpoint(folder, tag=TAG, client_state={UNIVERSAL_CHECKPOINT_INFO: {}})
        saved = hyperparameters(engine)
        assert [group["weight_decay"] for group in saved] == [0.1, 0.0]
        uninterrupted = train(engine, SAVE_STEPS, RESUME_STEPS)
        engine.destroy()
        if dist.get_rank() == 0:
            convert_to_universal(
                SimpleNamespace(input_folder=os.path.join(folder, TAG),
                                output_folder=os.path.join(folder, f"{TAG}_universal"),
                                num_extract_workers=1,
                                num_merge_workers=1,
                                keep_temp_folder=False,
                                strict=True,
                                inject_missing_state=False))
        dist.barrier()

        # The universal checkpoint, and the checkpoint itself as a load at the same size reads it.
        for load_universal, tag in ((True, f"{TAG}_universal"), (False, TAG)):
            engine = initialize(stage, dtype, load_universal=load_universal)
            engine.load_checkpoint(folder, tag=tag)
            assert hyperparameters(engine) == saved
            losses = train(engine, SAVE_STEPS, RESUME_STEPS)
            assert losses == pytest.approx(uninterrupted, rel=1e-5 if dtype == torch.float32 else 1e-2)
            engine.destroy()

        # An optimizer whose groups are not the saved ones is refused, not loaded into the first groups.
        engine = initialize(stage, dtype, load_universal=True, one_group=True)
        with pytest.raises(ValueError, match="has 2 parameter groups, this optimizer has 1"):
            engine.load_checkpoint(folder, tag=f"{TAG}_universal")
        engine.destroy()
