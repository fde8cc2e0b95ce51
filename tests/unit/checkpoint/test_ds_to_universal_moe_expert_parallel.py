# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``ds_to_universal`` of a checkpoint of ``deepspeed.moe`` layers saved at expert-parallel size 2
is refused with an error that names the expert-parallel size and the ways on, and one saved at
expert-parallel size 1 converts.

Each expert-parallel rank names the parameters of its experts by their index on that rank: at size
2, the two ranks' first experts (global ids 0 and 2) share a name in the optimizer states. On
deepspeed 0.19.8 the conversion failed with "shape '[16]' is invalid for input of size 32".
"""

import os

import pytest

import deepspeed.comm as dist

from unit.checkpoint.autotp_common import convert_to_universal_checkpoint
from unit.checkpoint.test_pipeline_moe_other_topology import TAG, make_engine, train_step
from unit.common import DistributedTest


class TestMoEUniversalConversion(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("ep_size", [1, 2])
    def test_converts_expert_parallel_size_1_only(self, ep_size, tmpdir):
        save_dir = str(tmpdir)
        engine = make_engine("moe", ep_size, 2)
        train_step(engine, seed=0)
        engine.save_checkpoint(save_dir, tag=TAG)
        if dist.get_rank() == 0:
            folders = os.path.join(save_dir, TAG), os.path.join(save_dir, "universal")
            if ep_size == 1:
                convert_to_universal_checkpoint(*folders, inject_missing_state=True)
                assert os.path.isdir(os.path.join(save_dir, "universal", "zero"))
            else:
                with pytest.raises(ValueError,
                                   match="deepspeed.moe layers were saved at expert-parallel size 2, .* Load it with "
                                   "load_checkpoint at expert-parallel size 2"):
                    convert_to_universal_checkpoint(*folders, inject_missing_state=True)
        dist.barrier()
