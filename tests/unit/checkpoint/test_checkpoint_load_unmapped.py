# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A job that resumes from a checkpoint keeps nothing of the checkpoint's files mapped.
``load_checkpoint`` reads each file through a memory map and copies its tensors out of it, so a job
trains on from what it loaded after the files were cut short or written over in place (``cp`` or a
sync tool writing another checkpoint over the folder). A tensor left in the map would make the job
die of SIGBUS at its next access once its file is cut short.
"""

import os

import pytest

from unit.checkpoint.test_checkpoint_weights_only import assert_weights_equal, full_weights, initialize, train_step
from unit.common import DistributedTest


@pytest.mark.skipif(not os.path.isfile("/proc/self/maps"), reason="reads the process's mappings from /proc")
class TestLoadCheckpointUnmapped(DistributedTest):
    world_size = 1
    reuse_dist_env = True

    @pytest.mark.parametrize("zero_stage", [2, 3])
    def test_training_goes_on_after_the_files_are_cut_short(self, tmpdir, zero_stage):
        save_dir = str(tmpdir / "ckpt")
        engine = initialize(zero_stage)
        train_step(engine)
        engine.save_checkpoint(save_dir, tag="t1")
        saved = full_weights(engine)
        train_step(engine)
        stepped = full_weights(engine)

        engine.load_checkpoint(save_dir, tag="t1")
        folder = os.path.join(save_dir, "t1")
        with open("/proc/self/maps") as fd:
            assert folder not in fd.read()
        for name in os.listdir(folder):
            os.truncate(os.path.join(folder, name), 0)
        assert_weights_equal(engine, saved)
        # The step reads the loaded optimizer states: it trains as the step after the save did.
        train_step(engine)
        assert_weights_equal(engine, stepped)
