# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A ZeRO checkpoint saved with torch's Adam resumes with the optimizer offloaded to the CPU, as users
switch ``offload_optimizer`` on between runs to fit a larger model. A 2-rank job of a small Llama
trains two steps with torch's Adam and the Hugging Face Trainer's two parameter groups, saves, and
trains on; a job with the same config but the optimizer offloaded (DeepSpeed's CPU Adam) loads the
checkpoint. Each group keeps its saved hyperparameters and CPU Adam's own settings, and the next
losses are those of the run that went on. ZeRO-2 and -3.

Before, the load succeeded and the next step failed with ``KeyError: 'bias_correction'``: torch's
``load_state_dict`` put torch's Adam's groups in place of CPU Adam's.
"""

import pytest
import torch

import deepspeed

from unit.common import DistributedTest

TAG = "step2"
SAVE_STEPS = 2
RESUME_STEPS = 2


def initialize(stage, offload):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(42)
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=64,
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    max_position_embeddings=8))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-2
            }
        },
        "zero_optimization": {
            "stage": stage
        },
    }
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    else:
        config["optimizer"]["params"]["torch_adam"] = True
    # The Trainer's groups: weight decay on matrices, none on norm weights.
    param_groups = [{
        "params": [param for param in model.parameters() if param.dim() >= 2],
        "weight_decay": 0.1
    }, {
        "params": [param for param in model.parameters() if param.dim() < 2],
        "weight_decay": 0.0
    }]
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=param_groups)
    return engine


def train(engine, first_step, steps):
    losses = []
    for step in range(first_step, first_step + steps):
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step)).to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


class TestResumeWithOptimizerOffloaded(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("stage", [2, 3])
    def test_offload_on(self, stage, tmpdir):
        engine = initialize(stage, offload=False)
        train(engine, 0, SAVE_STEPS)
        engine.save_checkpoint(str(tmpdir), tag=TAG)
        saved_groups = [{
            key: value
            for key, value in group.items() if key != "params"
        } for group in engine.optimizer.optimizer.param_groups]
        uninterrupted = train(engine, SAVE_STEPS, RESUME_STEPS)
        engine.destroy()

        engine = initialize(stage, offload=True)
        own_settings = [{
            key: group[key]
            for key in group if key not in saved_groups[index] and key != "params"
        } for index, group in enumerate(engine.optimizer.optimizer.param_groups)]
        assert all("bias_correction" in settings for settings in own_settings)
        engine.load_checkpoint(str(tmpdir), tag=TAG)
        for group, saved, own in zip(engine.optimizer.optimizer.param_groups, saved_groups, own_settings):
            assert {key: group[key] for key in saved if key != "params"} == saved
            assert {key: group[key] for key in own} == own
        losses = train(engine, SAVE_STEPS, RESUME_STEPS)
        assert losses == pytest.approx(uninterrupted, rel=1e-5)
        engine.destroy()
