# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A checkpoint saved after ``torch.serialization.set_crc32_options(False)``, torch's documented way
to save without computing zip checksums (``torch.load`` reads such files), converts with both
offline tools, ``zero_to_fp32`` and ``ds_to_universal``, which read rank files with ``torch.load``.
"""

import os

import pytest
import torch

import deepspeed
from deepspeed.checkpoint.ds_to_universal import main as convert_to_universal
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from unit.checkpoint.test_ds_to_universal_output import convert_args, make_engine, train
from unit.common import DistributedTest

TAG = "step1"


@pytest.mark.parametrize("stage", [2, 3])
class TestCheckpointWithoutCrc32(DistributedTest):
    world_size = 1

    def test(self, stage, tmpdir):
        engine = make_engine(stage)
        train(engine, 1, seed=1)
        save_dir = str(tmpdir.join("checkpoint"))
        torch.serialization.set_crc32_options(False)
        try:
            engine.save_checkpoint(save_dir, tag=TAG)
        finally:
            torch.serialization.set_crc32_options(True)
        expected = {}
        for name, param in engine.module.named_parameters():
            with deepspeed.zero.GatheredParameters([param]):
                expected[name] = param.detach().clone()

        state_dict = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag=TAG)
        assert sorted(state_dict) == sorted(expected)
        for name, value in expected.items():
            assert torch.equal(state_dict[name], value), name

        output_dir = str(tmpdir.join("universal"))
        convert_to_universal(convert_args(os.path.join(save_dir, TAG), output_dir))
        for name, value in expected.items():
            universal = torch.load(os.path.join(output_dir, "zero", name, "fp32.pt"), weights_only=False)
            assert torch.equal(universal["param"], value), name
