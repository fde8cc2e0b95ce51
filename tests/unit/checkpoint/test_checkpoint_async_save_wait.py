# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""With ``"checkpoint": {"async_save": true, "async_save_wait": "save"}`` the optimizer steps after a
background save do not wait for its writes, which overlap training until the next save, load or exit.

A 2-rank ZeRO-3 job saves in the background and takes three steps while its writer threads are held:
`latest` must still name the previous tag after them (with the default, ``"step"``, the first step
waits for the writes), and once the writes are released the files must hold exactly what a
synchronous save of the state at the save holds.
"""

import os
import threading

import torch

from unit.checkpoint.test_checkpoint_async_save import assert_same_files
from unit.checkpoint.test_checkpoint_killed_save import initialize, train_step
from unit.common import DistributedTest


class TestCheckpointAsyncSaveWait(DistributedTest):
    world_size = 2

    def test_writes_overlap_training_until_the_next_save(self, tmpdir):
        save_dir = str(tmpdir)
        engine = initialize(3)
        train_step(engine)
        engine.save_checkpoint(save_dir, tag="sync")
        engine.destroy()

        engine = initialize(3, async_save=True, async_save_wait="save")
        train_step(engine)
        steps_taken, real_save, training = threading.Event(), torch.save, threading.current_thread()

        def save_after_the_steps(*args, **kwargs):
            if threading.current_thread() is not training:
                # A step that waits for the writes waits here until the timeout.
                steps_taken.wait(timeout=10)
            return real_save(*args, **kwargs)

        torch.save = save_after_the_steps
        try:
            engine.save_checkpoint(save_dir, tag="async")
            for _ in range(3):
                train_step(engine)
            with open(os.path.join(save_dir, "latest")) as fd:
                assert fd.read() == "sync"
        finally:
            steps_taken.set()
            torch.save = real_save
        engine.wait_for_async_save()
        with open(os.path.join(save_dir, "latest")) as fd:
            assert fd.read() == "async"
        engine.destroy()
        assert_same_files(save_dir, "sync", "async")
