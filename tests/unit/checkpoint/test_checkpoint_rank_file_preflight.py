# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The offline tools check a checkpoint's rank files in one preflight, ``check_rank_files()``.

A 2-rank ZeRO-3 job saves a checkpoint, and the copy of it that reaches the user lacks rank 1's
optimizer file (a node's files that were not copied). ``zero_to_fp32`` and ``ds_to_universal`` refuse
it alike, before anything is written: the error names the missing file, says what was not done and
is both a ``FileNotFoundError`` and the ``ValueError`` that ``zero_to_fp32`` raises for an incomplete
checkpoint. Before, each tool had a preflight of its own: ``zero_to_fp32`` raised a ``ValueError``
only, ``ds_to_universal`` a ``FileNotFoundError`` only.
"""

import os

import pytest

import deepspeed.comm as dist
from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal
from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

from unit.checkpoint.test_ds_to_universal_output import convert_args, trained_checkpoint
from unit.common import DistributedTest


class TestRankFilePreflight(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test_missing_rank_file_is_refused_alike_by_both_tools(self, tmpdir):
        trained_checkpoint(3, str(tmpdir))
        dist.barrier()
        if dist.get_rank() == 0:
            tag_folder = os.path.join(str(tmpdir), "step2")
            missing = os.path.join(tag_folder, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
            os.remove(missing)
            output_dir = os.path.join(str(tmpdir), "fp32")
            with pytest.raises(FileNotFoundError, match=f"{missing} \\(missing\\).*It was not consolidated") as error:
                convert_zero_checkpoint_to_fp32_state_dict(str(tmpdir), output_dir, tag="step2")
            assert isinstance(error.value, ValueError)
            assert not os.path.exists(output_dir)

            output_folder = os.path.join(str(tmpdir), "step2_universal")
            with pytest.raises(ValueError, match=f"{missing} \\(missing\\).*It was not converted") as error:
                ds_to_universal(convert_args(tag_folder, output_folder))
            assert isinstance(error.value, FileNotFoundError)
            assert not os.path.exists(output_folder)
        dist.barrier()
