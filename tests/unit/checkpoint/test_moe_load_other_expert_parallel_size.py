# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``load_checkpoint()`` of a ZeRO-2 checkpoint of MoE layers at another expert-parallel size, or on
another number of ranks, loads straight from the rank files: four experts of ``deepspeed.moe`` and
of AutoEP's replacement of a Mixtral MoE block, saved on two ranks at expert-parallel size 2 and
loaded at 1 (also in bf16), saved at 1 and loaded at 2, and saved at 2 and loaded on one rank; on
four ranks, saved at expert-parallel size 2 (each expert partitioned over two ranks) and loaded at
4 and at 1. Right after the load every parameter's weights, fp32 weights and Adam moments are
those saved for the same expert, and the next losses are those of the run that went on
uninterrupted.

Each rank reads each of its experts' states from the files of the expert-parallel rank that saved
it, under the name that rank gave it. Before, such a load was refused (on deepspeed 0.19.8, AutoEP's
returned with each expert's states taken from another expert's).
"""

import os

import pytest
import torch

import deepspeed.comm as dist

from unit.checkpoint.test_ds_to_universal_moe_expert_parallel import load_and_compare, save
from unit.checkpoint.test_pipeline_moe_other_topology import TAG
from unit.common import DistributedTest


@pytest.fixture(scope="module")
def save_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("moe_other_ep_size"))


class TestMoELoadOtherExpertParallelSize(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("kind", ["moe", "autoep"])
    @pytest.mark.parametrize("saved_size, size, bf16", [(2, 1, False), (1, 2, False), (2, 1, True)])
    def test_loads_exactly(self, kind, saved_size, size, bf16, tmpdir):
        saved, next_losses = save(str(tmpdir), kind, saved_size, bf16)
        load_and_compare(str(tmpdir), TAG, kind, size, saved, next_losses, bf16)

    @pytest.mark.world_size(4)
    @pytest.mark.parametrize("kind", ["moe", "autoep"])
    @pytest.mark.parametrize("saved_size, size", [(2, 4), (2, 1)])
    def test_loads_exactly_on_4_ranks(self, kind, saved_size, size, tmpdir):
        # At expert-parallel size 2 each expert-parallel rank's experts are partitioned over two ranks.
        saved, next_losses = save(str(tmpdir), kind, saved_size)
        load_and_compare(str(tmpdir), TAG, kind, size, saved, next_losses)

    def test_save_on_2_ranks(self, save_dir):
        saved, next_losses = save(save_dir, "moe", 2)
        if dist.get_rank() == 0:
            torch.save((saved, next_losses), os.path.join(save_dir, "expected.pt"))
        dist.barrier()

    @pytest.mark.world_size(1)
    def test_load_on_1_rank(self, save_dir):
        saved, next_losses = torch.load(os.path.join(save_dir, "expected.pt"))
        # Its first batch is the one rank 0 of the saving run took next.
        load_and_compare(save_dir, TAG, "moe", 1, saved, next_losses[:1])
