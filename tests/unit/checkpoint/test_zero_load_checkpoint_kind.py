# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A job that turns ZeRO on to fit a larger model, or off, and resumes with its optimizer states.

Without ZeRO the optimizer states are saved in the model states file, with ZeRO in the ZeRO optimizer
files. A 2-rank job of a small Llama trains two steps with Adam and saves, with or without ZeRO; a job
of the other kind loads the checkpoint with its optimizer states. The load must be refused before
anything changed, on every rank, naming how the checkpoint was saved and what to do.

Before, a ZeRO-1/2 engine replaced the module's weights, then failed on the missing ZeRO optimizer
file; an engine without ZeRO failed with ``AttributeError: 'NoneType' object has no attribute 'copy'``
from a ZeRO-1/2 checkpoint; and the engines of ZeRO-3 and without ZeRO, which name their model states
files otherwise, did not find each other's, and failed without saying why.
"""

import pytest
import torch

import deepspeed
from deepspeed.runtime.zero.utils import ZeRORuntimeException

from unit.common import DistributedTest

TAG = "step2"


def initialize(stage):
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
                "lr": 1e-2,
                "torch_adam": True
            }
        },
        "zero_optimization": {
            "stage": stage
        },
    }
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    return engine


def module_weights(engine):
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: param.detach().clone() for name, param in params.items()}


class TestLoadCheckpointOfTheOtherKind(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("saved_stage,stage", [(0, 2), (0, 3), (2, 0), (3, 0)])
    def test_refused(self, saved_stage, stage, tmpdir):
        engine = initialize(saved_stage)
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(7))
        for _ in range(2):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        engine.save_checkpoint(str(tmpdir), tag=TAG)
        engine.destroy()

        engine = initialize(stage)
        before = module_weights(engine)
        saved = f"saved with ZeRO stage {saved_stage}" if saved_stage else "saved without ZeRO"
        now = f"into this engine at ZeRO stage {stage}" if stage else "into this engine without ZeRO"
        with pytest.raises(ZeRORuntimeException, match=f"the checkpoint .*, {saved}, {now}: .* Nothing was loaded"):
            engine.load_checkpoint(str(tmpdir), tag=TAG)
        after = module_weights(engine)
        assert all(torch.equal(after[name], value) for name, value in before.items())
        engine.destroy()
