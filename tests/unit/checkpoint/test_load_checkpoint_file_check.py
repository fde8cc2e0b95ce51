# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``load_checkpoint`` of a tag with a missing rank file is refused on every rank, and each rank
opens only its own files to find out.

A job restarts from a checkpoint whose last rank's optimizer file is missing (a node lost its
writes). Every rank, not only the one that would read the file, must raise the same error naming
it before anything is loaded; and no rank may open the other ranks' files to check them, which at
thousands of ranks would be millions of opens on a shared filesystem at every restart.
"""

import os
import re
import sys

import pytest

import deepspeed.comm as dist
from unit.checkpoint.test_checkpoint_killed_save import initialize, train_step
from unit.common import DistributedTest

opened = []


def record_opens(event, args):
    if event == "open" and isinstance(args[0], str):
        opened.append(args[0])


class TestLoadCheckpointFileCheck(DistributedTest):
    world_size = [2, 4]

    def test_missing_file_of_another_rank_is_refused_on_every_rank(self, tmpdir):
        save_dir = str(tmpdir)
        engine = initialize(stage=2)
        train_step(engine)
        engine.save_checkpoint(save_dir, tag="global_step1")
        engine.save_checkpoint(save_dir, tag="global_step2")
        last = dist.get_world_size() - 1
        missing = os.path.join(save_dir, "global_step2", f"zero_pp_rank_{last}_mp_rank_00_optim_states.pt")
        dist.barrier()
        if dist.get_rank() == 0:
            os.remove(missing)
        dist.barrier()

        with pytest.raises(ValueError, match=re.escape(f"{missing} (missing)")):
            engine.load_checkpoint(save_dir, tag="global_step2")

        # Each rank opens its own optimizer file, and no other rank's.
        sys.addaudithook(record_opens)
        opened.clear()
        engine.load_checkpoint(save_dir, tag="global_step1")
        optimizer_files = {path for path in opened if path.endswith("_optim_states.pt")}
        assert optimizer_files == {
            os.path.join(save_dir, "global_step1", f"zero_pp_rank_{dist.get_rank()}_mp_rank_00_optim_states.pt")
        }
