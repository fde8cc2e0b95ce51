# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``ds_to_universal`` converts a ZeRO-1/2 checkpoint in ``_convert_zero12()``, whose steps are
functions of their own: the fragments of the rank files, the merge of each parameter, the parameters
that the optimizer does not hold (``_save_params_without_fragments()``) and the copy of the model
states files (``_copy_model_states()``). Here a model is fine-tuned at ZeRO-2 with its embedding
frozen: its head comes out of the optimizer's fragments, with Adam's moments, and the frozen
embedding, which no fragment holds, out of the model states.
"""

import os

import torch
import torch.nn as nn

import deepspeed
from deepspeed.checkpoint.constants import PARAM
from deepspeed.checkpoint.ds_to_universal import _convert_zero12
from deepspeed.utils import safe_get_full_fp32_param

from unit.checkpoint.test_ds_to_universal_output import convert_args
from unit.common import DistributedTest

HIDDEN = 8


class FrozenEmbeddingModel(nn.Module):

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(16, HIDDEN)
        self.embedding.weight.requires_grad_(False)
        self.head = nn.Linear(HIDDEN, 4)

    def forward(self, tokens):
        return self.head(self.embedding(tokens)).square().mean()


class TestConvertZero12(DistributedTest):
    world_size = 1

    def test_frozen_embedding_comes_from_the_model_states(self, tmpdir):
        torch.manual_seed(0)
        model = FrozenEmbeddingModel()
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
                "stage": 2
            },
        }
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        engine.backward(engine(torch.randint(0, 16, (2, 3))))
        engine.step()
        engine.save_checkpoint(str(tmpdir), tag="step1")

        output = os.path.join(str(tmpdir), "step1_universal")
        os.makedirs(output)
        _convert_zero12(convert_args(os.path.join(str(tmpdir), "step1"), output))

        def saved(name, state):
            return torch.load(os.path.join(output, "zero", name, f"{state}.pt"), weights_only=False)[PARAM]

        for name in ("head.weight", "head.bias"):
            param = dict(engine.module.named_parameters())[name]
            assert torch.equal(saved(name, "fp32"), safe_get_full_fp32_param(param)), name
            assert os.path.isfile(os.path.join(output, "zero", name, "exp_avg.pt")), name
        assert torch.equal(saved("embedding.weight", "fp32"), model.embedding.weight.float())
        assert not os.path.exists(os.path.join(output, "zero", "embedding.weight", "exp_avg.pt"))
        assert os.path.isfile(os.path.join(output, "mp_rank_00_model_states.pt"))
