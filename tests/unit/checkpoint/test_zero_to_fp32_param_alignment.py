# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A ZeRO-1/2 checkpoint saved with ``"parameter_alignment": true``, whose flat buffers put padding
after each parameter, is described by the checkpoint layout module: the partitioning rule, given the
recorded paddings, places every parameter's fragments where each rank file records them, and
``zero_to_fp32`` (which reads through it) gives the engine's fp32 weights. Two parameter groups,
parameters of odd sizes, 2 ranks.

Before, only ``zero_to_fp32`` applied the paddings, with a walk of its own; the layout module's
rule took no paddings.
"""

import os

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.checkpoint.constants import (OPTIMIZER_STATE_DICT, PARAM_ALIGNMENT_PADDINGS, PARAM_SHAPES,
                                            PARAM_SLICE_MAPPINGS, SINGLE_PARTITION_OF_FP32_GROUPS)
from deepspeed.checkpoint.utils import load_checkpoint_file
from deepspeed.checkpoint.zero_layout import zero_partition_fragments
from deepspeed.utils import safe_get_full_fp32_param
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from unit.common import DistributedTest

TAG = "step2"


@pytest.mark.parametrize("stage", [1, 2])
class TestZeroToFp32ParamAlignment(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test(self, stage, tmpdir):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3),
                                    torch.nn.Linear(3, 1))
        param_groups = [{
            "params": [param for param in model.parameters() if param.dim() == 2],
            "weight_decay": 0.1
        }, {
            "params": [param for param in model.parameters() if param.dim() == 1],
            "weight_decay": 0.0
        }]
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {
                "type": "AdamW",
                "params": {
                    "lr": 1e-2,
                    "torch_adam": True
                }
            },
            "zero_optimization": {
                "stage": stage,
                "parameter_alignment": True
            },
        }
        engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=param_groups)
        for _ in range(2):
            loss = engine(torch.randn(2, 13)).pow(2).mean()
            engine.backward(loss)
            engine.step()
        save_dir = str(tmpdir)
        engine.save_checkpoint(save_dir, tag=TAG)
        weights = {name: safe_get_full_fp32_param(param).clone() for name, param in engine.module.named_parameters()}
        if dist.get_rank() == 0:
            optim_sds = [
                load_checkpoint_file(os.path.join(
                    save_dir, TAG, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))[OPTIMIZER_STATE_DICT]
                for rank in range(2)
            ]
            paddings = optim_sds[0][PARAM_ALIGNMENT_PADDINGS]
            assert any(padding for group in paddings for padding in group)
            param_shapes = load_checkpoint_file(os.path.join(save_dir, TAG,
                                                             "mp_rank_00_model_states.pt"))[PARAM_SHAPES]
            partition_numels = [len(partition) for partition in optim_sds[0][SINGLE_PARTITION_OF_FP32_GROUPS]]
            by_rule = {(dp_index, group, name, start, numel)
                       for dp_index, group, name, start, numel in zero_partition_fragments(
                           param_shapes, partition_numels, 2, alignment_paddings=paddings) if numel}
            recorded = {(dp_index, group, name, fragment.start, fragment.numel)
                        for dp_index, optim_sd in enumerate(optim_sds)
                        for group, mappings in enumerate(optim_sd[PARAM_SLICE_MAPPINGS])
                        for name, fragment in mappings.items() if fragment.numel}
            assert by_rule == recorded

            state_dict = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag=TAG)
            assert sorted(state_dict) == sorted(weights)
            for name, value in weights.items():
                assert torch.equal(state_dict[name], value), name
        dist.barrier()
