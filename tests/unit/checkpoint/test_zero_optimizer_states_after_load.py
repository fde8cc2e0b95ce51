# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Right after a ZeRO-1/2 job loads the checkpoint it saved, on the same ranks, each parameter's
optimizer states read through ``safe_get_full_optimizer_state()``: a script or callback that checks
what it resumed, before training on. A 2-rank job of a small Llama trains two steps with Adam and
saves; a new engine loads the checkpoint, and the gathered Adam moments of every parameter must be
those the run had when it saved. ZeRO-2, and ZeRO-1 in bf16 (the BF16 optimizer).

Before, ZeRO-1/2 linked each parameter to its optimizer states only at the first step, so the call
raised ``TypeError: argument of type 'NoneType' is not iterable`` until then, although the states
were loaded.
"""

import pytest
import torch

import deepspeed
from deepspeed.utils import safe_get_full_optimizer_state

from unit.common import DistributedTest

TAG = "step2"


def build_model(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(42)
    return LlamaForCausalLM(
        LlamaConfig(vocab_size=64,
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    max_position_embeddings=8)).to(dtype)


def initialize(stage, dtype):
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
        "bf16": {
            "enabled": dtype == torch.bfloat16
        },
    }
    model = build_model(dtype)
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    return engine


def adam_states(engine):
    return {
        (name, key): safe_get_full_optimizer_state(param, key).clone()
        for name, param in engine.module.named_parameters()
        for key in ("exp_avg", "exp_avg_sq")
    }


class TestZeroOptimizerStatesAfterLoad(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("stage, dtype", [(2, torch.float32), (1, torch.bfloat16)])
    def test_same_ranks(self, stage, dtype, tmpdir):
        engine = initialize(stage, dtype)
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(7))
        for _ in range(2):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        engine.save_checkpoint(str(tmpdir), tag=TAG)
        saved = adam_states(engine)
        engine.destroy()

        engine = initialize(stage, dtype)
        engine.load_checkpoint(str(tmpdir), tag=TAG)
        loaded = adam_states(engine)
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), key
        engine.destroy()
