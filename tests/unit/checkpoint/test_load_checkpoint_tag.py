# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``load_checkpoint(dir, tag=X, load_optimizer_states=False)`` at ZeRO-3 loads the weights of X.

Evaluation, a rollback, or a fine-tuning run that starts from an earlier checkpoint of a training run
loads that checkpoint's weights without its optimizer states. ZeRO-3 rebuilds the weights from the
checkpoint's partitions, and used to read the tag that ``latest`` names instead of the one asked for
(upstream issue #8499).
"""

import os

import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from unit.common import DistributedTest

SEQ_LEN = 8


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(42)
    config = LlamaConfig(vocab_size=64,
                         hidden_size=32,
                         intermediate_size=64,
                         num_hidden_layers=2,
                         num_attention_heads=4,
                         num_key_value_heads=2,
                         max_position_embeddings=SEQ_LEN)
    return LlamaForCausalLM(config)


def initialize():
    model = build_model()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
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
    }
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    return engine


def train(engine, steps):
    generator = torch.Generator().manual_seed(engine.global_steps * dist.get_world_size() + dist.get_rank())
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, SEQ_LEN), generator=generator).to(get_accelerator().current_device_name())
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()


def full_weights(engine):
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: param.detach().cpu().clone() for name, param in params.items()}


def assert_weights_equal(engine, expected):
    actual = full_weights(engine)
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


class TestZeRO3LoadCheckpointTag(DistributedTest):
    world_size = [1, 2]
    reuse_dist_env = True

    def test_loads_the_requested_tag_without_optimizer_states(self, tmpdir):
        save_dir = str(tmpdir)
        engine = initialize()
        train(engine, steps=1)
        engine.save_checkpoint(save_dir, tag="global_step1")
        early = full_weights(engine)
        train(engine, steps=2)
        engine.save_checkpoint(save_dir, tag="global_step3")
        late = full_weights(engine)
        assert any(not torch.equal(early[name], late[name]) for name in early)

        # A fresh engine for evaluation: `latest` names global_step3.
        fresh = initialize()
        load_path, _ = fresh.load_checkpoint(save_dir, tag="global_step1", load_optimizer_states=False)
        assert os.path.dirname(load_path) == os.path.join(save_dir, "global_step1")
        assert_weights_equal(fresh, early)

        # Without a `latest` file, a tag that exists still loads.
        dist.barrier()
        if dist.get_rank() == 0:
            os.remove(os.path.join(save_dir, "latest"))
        dist.barrier()
        fresh.load_checkpoint(save_dir, tag="global_step3", load_optimizer_states=False)
        assert_weights_equal(fresh, late)
