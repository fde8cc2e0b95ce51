# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A universal checkpoint with a bad file is refused on every rank before anything is loaded.

A 2-rank ZeRO-2 job saves a checkpoint, ``ds_to_universal`` converts it, and one bit is flipped in
the Adam moments of the last parameter, whose fragments only rank 1 holds. A job that loads the
universal checkpoint must raise on both ranks, naming the file and its record, with the module's
weights unchanged, well within the test's timeout.

Before, each rank verified the files it read as it read them: rank 1 raised, and rank 0 waited in
its next collective until the job was killed.
"""

import os

import pytest
import torch

import deepspeed.comm as dist

from unit.checkpoint.autotp_common import convert_to_universal_checkpoint
from unit.checkpoint.test_checkpoint_crc32 import flip_bit
from unit.checkpoint.test_checkpoint_killed_save import full_weights, initialize, train_step
from unit.common import DistributedTest


class TestUniversalLoadFileCheck(DistributedTest):
    world_size = 2
    reuse_dist_env = True
    # A rank left waiting for another that raised fails the test here, not after the default 600 s.
    exec_timeout = 120

    def test_bad_file_is_refused_on_every_rank(self, tmpdir):
        save_dir = str(tmpdir)
        engine = initialize(2)
        train_step(engine)
        engine.save_checkpoint(save_dir, tag="step1")
        last_param = list(engine.module.named_parameters())[-1][0]
        changed = os.path.join(save_dir, "step1_universal", "zero", last_param, "exp_avg.pt")
        if dist.get_rank() == 0:
            convert_to_universal_checkpoint(os.path.join(save_dir, "step1"), os.path.join(save_dir, "step1_universal"))
            flip_bit(changed)
        dist.barrier()

        fresh = initialize(2, load_universal=True)
        weights = full_weights(fresh)
        with pytest.raises(ValueError, match=f"{changed} \\(record '.*fails its CRC-32 check"):
            fresh.load_checkpoint(save_dir, tag="step1_universal")
        actual = full_weights(fresh)
        for name, tensor in weights.items():
            assert torch.equal(actual[name], tensor), name
