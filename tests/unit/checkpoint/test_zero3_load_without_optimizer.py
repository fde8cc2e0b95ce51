# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""An engine without an optimizer loads the weights of a ZeRO-3 checkpoint (#7272).

To evaluate a checkpoint, a script (or PyTorch Lightning's ``trainer.validate(ckpt_path=...)`` and
``trainer.test``) builds an engine without an optimizer and loads the checkpoint into it, with
``load_optimizer_states=False`` (as Lightning does) or the default. A 2-rank ZeRO-3 job with Adam
trains a step and saves; an engine without an optimizer, at ZeRO-3 on 2 ranks and on 1, loads it
either way: its weights must be those of the saved engine, and it must compute the same loss.

Before, every such load raised ``AttributeError``: "'DeepSpeedZeRoOffload' object has no attribute
'_restore_from_bit16_weights'" (or no ``load_state_dict`` with the default).
"""

import os

import pytest
import torch

import deepspeed
import deepspeed.comm as dist

from unit.common import DistributedTest

TAG = "step1"


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(42)
    return LlamaForCausalLM(
        LlamaConfig(vocab_size=64,
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    max_position_embeddings=8))


def initialize(with_optimizer):
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
    model = build_model()
    if with_optimizer:
        config["optimizer"] = {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}
        engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    else:
        engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    return engine


def batch():
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(7))


def full_weights(engine):
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: param.detach().clone() for name, param in params.items()}


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("zero3_load_without_optimizer"))


class TestZero3LoadWithoutOptimizer(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test_save(self, checkpoint_dir):
        engine = initialize(with_optimizer=True)
        ids = batch()
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        engine.save_checkpoint(checkpoint_dir, tag=TAG)
        weights = full_weights(engine)
        loss = engine(input_ids=ids, labels=ids).loss.item()
        if dist.get_rank() == 0:
            torch.save({"weights": weights, "loss": loss}, os.path.join(checkpoint_dir, "expected.pt"))

    @pytest.mark.world_size(2, 1)
    @pytest.mark.parametrize("load_optimizer_states", [False, True])
    def test_load(self, checkpoint_dir, load_optimizer_states):
        expected = torch.load(os.path.join(checkpoint_dir, "expected.pt"))
        engine = initialize(with_optimizer=False)
        engine.load_checkpoint(checkpoint_dir, tag=TAG, load_optimizer_states=load_optimizer_states)
        weights = full_weights(engine)
        for name, tensor in expected["weights"].items():
            assert torch.equal(weights[name], tensor), name
        ids = batch()
        assert engine(input_ids=ids, labels=ids).loss.item() == expected["loss"]
