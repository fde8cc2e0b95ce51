# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``ds_to_universal`` converts a ZeRO-3 checkpoint in ``_convert_zero3()``, whose steps are
functions of their own: the AutoEP checks, the fragments of the rank files, the merge of each
parameter from the partitions of every rank (``_merge_zero3_params()``) and the copy of the model
states files (``_copy_model_states()``). Here a 2-rank ZeRO-3 job's checkpoint, each parameter
partitioned over both ranks, converts into each parameter whole, with Adam's moments, and both
ranks' model states files.
"""

import os

import torch

import deepspeed.comm as dist
from deepspeed.checkpoint.constants import PARAM
from deepspeed.checkpoint.ds_to_universal import _convert_zero3, _get_optim_files
from deepspeed.utils import safe_get_full_fp32_param

from unit.checkpoint.test_ds_to_universal_output import convert_args, make_engine, train
from unit.common import DistributedTest


class TestConvertZero3(DistributedTest):
    world_size = 2

    def test_each_parameter_is_whole(self, tmpdir):
        engine = make_engine(3)
        train(engine, steps=1, seed=0)
        engine.save_checkpoint(str(tmpdir), tag="step1")
        weights = {name: safe_get_full_fp32_param(param) for name, param in engine.module.named_parameters()}

        output = os.path.join(str(tmpdir), "step1_universal")
        if dist.get_rank() == 0:
            input_folder = os.path.join(str(tmpdir), "step1")
            os.makedirs(output)
            _convert_zero3(convert_args(input_folder, output), _get_optim_files(input_folder))
            for name, weight in weights.items():
                saved = torch.load(os.path.join(output, "zero", name, "fp32.pt"), weights_only=False)[PARAM]
                assert torch.equal(saved, weight), name
                assert os.path.isfile(os.path.join(output, "zero", name, "exp_avg.pt")), name
            for rank in range(2):
                assert os.path.isfile(os.path.join(output, f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"))
        dist.barrier()
