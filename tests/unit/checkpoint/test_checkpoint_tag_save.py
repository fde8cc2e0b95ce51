# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A checkpoint tag is saved in three steps that any checkpoint engine's files go through.

``begin_save()`` readies the tag's folder before any rank writes into it, the checkpoint engine
writes the files, and ``commit_save()`` records which files the save wrote, then moves ``latest``
(``deepspeed/runtime/checkpoint_engine/tag_commit.py``). Here a script keeps one tag, ``last``, and
saves it again, as PyTorch Lightning's DeepSpeed strategy does: between the two steps of the second
save the tag is refused by name, what a save of it that was killed left is removed, and once the
save is committed the tag holds its files alone.
"""

import os

from deepspeed.checkpoint.integrity import checkpoint_file_problems
from deepspeed.checkpoint.utils import load_checkpoint_file
from deepspeed.runtime.checkpoint_engine import CheckpointCommitInfo, TorchCheckpointEngine
from deepspeed.runtime.checkpoint_engine.tag_commit import CheckpointStorage, begin_save, commit_save

from unit.common import DistributedTest


class TestTagSave(DistributedTest):
    world_size = 1

    def test_a_tag_saved_again_is_refused_until_its_save_is_committed(self, tmpdir):
        save_dir, tag = str(tmpdir), "last"
        checkpoint_engine = TorchCheckpointEngine()
        storage = CheckpointStorage(global_rank=0, local_rank=0, node_local=False)
        path = os.path.join(save_dir, tag, "mp_rank_00_model_states.pt")
        for step in (1, 2):
            checkpoint_engine.create(CheckpointCommitInfo(tag=tag, save_dir=save_dir, save_latest=True))
            if step == 2:
                # What a save of the tag that was killed half way left.
                abandoned = os.path.join(save_dir, tag, ".mp_rank_00_model_states.pt.0123456789abcdef.tmp")
                open(abandoned, "wb").close()
            begin_save(checkpoint_engine, storage, save_dir, tag, fsync=False)
            if step == 2:
                assert not os.path.exists(abandoned)
                problems = checkpoint_file_problems([path])
                assert problems and all(tag in problem for problem in problems), problems
            checkpoint_engine.save({"step": step}, path)
            commit_save(checkpoint_engine, None, storage, save_dir, tag, save_latest=True, fsync=False)

        with open(os.path.join(save_dir, "latest")) as fd:
            assert fd.read() == tag
        assert checkpoint_file_problems([path]) == []
        assert load_checkpoint_file(path)["step"] == 2
