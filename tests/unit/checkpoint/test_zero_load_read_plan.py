# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A rank that loads a ZeRO checkpoint at another data-parallel size opens only the optimizer files
that hold its new partition, and the first, which records where the elements of the others lie.

On a shared filesystem a restart of M ranks from a checkpoint of N ranks opened, checked and mapped
all N optimizer files on every rank, N * M opens in all, although each rank's new partition lies in
about N/M of them. A checkpoint of 4 ranks, at ZeRO-2 and ZeRO-3, is loaded at 2: every parameter
of the model (at ZeRO-3) and each parameter group's flat buffer (at ZeRO-2) has a multiple of 8
elements, so the first new rank's partition lies in the files of saved ranks 0 and 1, the second's
in those of ranks 2 and 3. Each rank opens those files and rank 0's, no other; the load is exact
as the other loads at another data-parallel size are (the optimizer states, the weights and the
next losses of the run that saved the checkpoint).
"""

import os
import re

import pytest
import torch

import deepspeed.comm as dist

from unit.common import DistributedTest
from unit.checkpoint import zero_load_common
from unit.checkpoint.zero_load_common import load_and_train, save

# The fixtures: the folder the source checkpoints are saved in, once per session, and a test's source.
cache = zero_load_common.cache
saved = zero_load_common.saved

# Each source checkpoint: stage, tp, dp, dtype, optimizer.
SOURCES = {
    "stage2-tp1dp4": (2, 1, 4, torch.float32, "adam"),
    "stage3-tp1dp4": (3, 1, 4, torch.float32, "adam"),
}


class TestSave(DistributedTest):
    world_size = 4

    @pytest.mark.parametrize("source", list(SOURCES))
    def test_ws4(self, source, cache):
        save(cache, source, SOURCES[source])


class TestLoad(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("source", list(SOURCES))
    def test_each_rank_opens_the_files_of_its_partition(self, source, saved):
        opened = []
        load_and_train(saved, SOURCES[source], dp_size=2, opened=opened)
        optimizer_files = {
            int(match.group(1))
            for match in (re.search(r"rank_(\d+)_mp_rank_00_optim_states\.pt$", os.path.basename(path))
                          for path in opened) if match
        }
        assert optimizer_files == ({0, 1} if dist.get_rank() == 0 else {0, 2, 3})
