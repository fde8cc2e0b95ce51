# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A ZeRO checkpoint loaded into an optimizer whose groups hold the parameters in another order.

The Hugging Face Trainer puts the parameters that decay and those that do not into two groups; a
script that builds them from a set, or after a refactor that registers modules in another order,
resumes with the same parameters in another order. A 2-rank job of a small Llama trains two steps
with Adam and saves; a job with each group's parameters in the reverse order loads the checkpoint.
Every parameter must then hold its own fp32 weights, or the load must be refused, naming the order,
before the module or the optimizer changed. ZeRO stages 1, 2 and 3.

Before, the flat partitions were loaded element by element as saved: every parameter silently took
other parameters' fp32 weights and optimizer states.
"""

import pytest
import torch

import deepspeed
from deepspeed.runtime.zero.utils import ZeRORuntimeException
from deepspeed.utils import safe_get_full_fp32_param

from unit.common import DistributedTest

TAG = "step2"


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


def trainer_param_groups(model, reverse):
    """The Trainer's groups: weights decay, biases and norms do not; with ``reverse``, each group's
    parameters in the reverse order."""
    decay = [param for param in model.parameters() if param.dim() >= 2]
    no_decay = [param for param in model.parameters() if param.dim() < 2]
    if reverse:
        decay, no_decay = decay[::-1], no_decay[::-1]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def initialize(stage, reverse):
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-2,
                "torch_adam": True
            }
        },
        "zero_optimization": {
            "stage": stage
        },
    }
    model = build_model()
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           config=config,
                                           model_parameters=trainer_param_groups(model, reverse))
    return engine


def fp32_weights(engine):
    return {name: safe_get_full_fp32_param(param).clone() for name, param in engine.module.named_parameters()}


def module_weights(engine):
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: param.detach().clone() for name, param in params.items()}


class TestZeroLoadParamOrder(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("stage", [1, 2, 3])
    def test_reordered(self, stage, tmpdir):
        engine = initialize(stage, reverse=False)
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(7))
        for _ in range(2):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        engine.save_checkpoint(str(tmpdir), tag=TAG)
        saved = fp32_weights(engine)
        engine.destroy()

        engine = initialize(stage, reverse=True)
        before, module_before = fp32_weights(engine), module_weights(engine)
        try:
            engine.load_checkpoint(str(tmpdir), tag=TAG)
        except ZeRORuntimeException as error:
            assert "in another order" in str(error) and "Nothing was loaded" in str(error), str(error)
            after, module_after = fp32_weights(engine), module_weights(engine)
            for name in before:
                assert torch.equal(after[name], before[name]), name
                assert torch.equal(module_after[name], module_before[name]), name
        else:
            loaded = fp32_weights(engine)
            for name, tensor in saved.items():
                assert torch.equal(loaded[name], tensor), name
        engine.destroy()
