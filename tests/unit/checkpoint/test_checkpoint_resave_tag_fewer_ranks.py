# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A tag saved again by a job on fewer ranks holds that save alone, and loads on more ranks.

PyTorch Lightning saves every checkpoint under the tag "checkpoint" (its ``last.ckpt`` is saved
again at each epoch), so a run resumed on fewer ranks saves that tag again with fewer rank files.
A 2-rank ZeRO-3 job saves the tag; a 1-rank job resumes from it, trains a step and saves the tag
again; a 2-rank job then loads it. The rank files of the first save that the second did not write
(rank 1's) must be gone, and the last job must get the weights of the second save.

Before, they stayed in the tag beside the second save's files: the 2-rank load took them for part
of the checkpoint and was refused ("not the file that the tag's last save wrote").

The names that a save removes come from the tag's record, ``checkpoint_manifest.json``: a record that
names a file outside the tag (crafted, or copied with a downloaded checkpoint) is refused by the next
save and load on every rank, and the file is left as it is. Before, the save removed it.
"""

import json
import os
import re

import pytest
import torch

import deepspeed.comm as dist

from unit.checkpoint.test_checkpoint_killed_save import full_weights, initialize, train_step
from unit.common import DistributedTest

TAG = "checkpoint"


@pytest.fixture(scope="module")
def save_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("resave_fewer_ranks"))


class TestResaveTagFewerRanks(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test_save_on_2_ranks(self, save_dir):
        engine = initialize(3)
        train_step(engine)
        engine.save_checkpoint(save_dir, tag=TAG)

    @pytest.mark.world_size(1)
    def test_save_again_on_1_rank(self, save_dir):
        engine = initialize(3)
        engine.load_checkpoint(save_dir, tag=TAG)
        train_step(engine)
        engine.save_checkpoint(save_dir, tag=TAG)
        torch.save(full_weights(engine), os.path.join(save_dir, "expected.pt"))
        names = sorted(os.listdir(os.path.join(save_dir, TAG)))
        assert not [name for name in names if name.startswith("zero_pp_rank_1_")], names

    def test_load_on_2_ranks(self, save_dir):
        expected = torch.load(os.path.join(save_dir, "expected.pt"))
        engine = initialize(3)
        engine.load_checkpoint(save_dir, tag=TAG)
        actual = full_weights(engine)
        for name, tensor in expected.items():
            assert torch.equal(actual[name], tensor), name
        dist.barrier()

    @pytest.mark.parametrize("relative", [True, False])
    def test_record_naming_a_file_outside_the_tag(self, tmpdir, relative):
        save_dir = os.path.join(tmpdir, "checkpoints")
        precious = os.path.join(tmpdir, "precious.txt")
        name = os.path.join("..", "..", "precious.txt") if relative else precious
        engine = initialize(1)
        engine.save_checkpoint(save_dir, tag=TAG)
        if dist.get_rank() == 0:
            with open(precious, "w") as fd:
                fd.write("the user's own file")
            manifest = os.path.join(save_dir, TAG, "checkpoint_manifest.json")
            with open(manifest) as fd:
                record = json.load(fd)
            record["files"][name] = None
            with open(manifest, "w") as fd:
                json.dump(record, fd)
        dist.barrier()

        with pytest.raises(ValueError, match=f"names {re.escape(repr(name))}, which is not a file name"):
            engine.save_checkpoint(save_dir, tag=TAG)
        with pytest.raises(ValueError, match=f"names {re.escape(repr(name))}, which is not a file name"):
            engine.load_checkpoint(save_dir, tag=TAG)
        with open(precious) as fd:
            assert fd.read() == "the user's own file"
