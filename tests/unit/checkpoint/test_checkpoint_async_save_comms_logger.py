# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""With the comms logger on, the thread of a background save neither times collectives nor
synchronizes the device.

To time a collective for the comms logger, deepspeed.comm synchronizes the device after it (with MPI,
it also calls a barrier of the whole world) and keeps the time in one table for the job. From the
thread that writes a background save beside training, that would stall training's stream, call a world
collective that training's collectives can interleave with, and mix the save's calls into the record
of training's. The thread meets the other ranks through a store of its own instead. A 2-rank ZeRO-2
job with the comms logger timing every call saves in the background, and ``threading.setprofile()``
records each call in the save's thread into the comms logger and each synchronization of the device:
there must be none, and the save must complete with `latest` naming the tag.
"""

import os
import threading

import deepspeed.comm as dist
import deepspeed.utils.comms_logging

from unit.checkpoint.test_checkpoint_killed_save import initialize, train_step
from unit.common import DistributedTest


class TestAsyncSaveCommsLogger(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test_background_save_is_not_timed(self, tmpdir):
        save_dir = str(tmpdir)
        engine = initialize(2, async_save=True)
        train_step(engine)
        timing_calls = []

        def record_timing_calls(frame, event, arg):
            code = frame.f_code
            if event == "call" and (code.co_name == "synchronize"
                                    or code.co_filename == deepspeed.utils.comms_logging.__file__):
                timing_calls.append(f"{threading.current_thread().name}: {code.co_name}")

        dist.configure(enabled=True, prof_all=True)
        threading.setprofile(record_timing_calls)
        try:
            engine.save_checkpoint(save_dir, tag="step1")
            engine.wait_for_async_save()
        finally:
            threading.setprofile(None)
            dist.configure(enabled=False, prof_all=False)
        assert timing_calls == []
        with open(os.path.join(save_dir, "latest")) as fd:
            assert fd.read() == "step1"
