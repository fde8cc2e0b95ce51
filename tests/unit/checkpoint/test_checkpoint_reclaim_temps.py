# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The next save of a tag removes the temporary files that a killed save of it left, and only those.

A save killed half way leaves the hidden temporary files of ``atomic_write`` in the tag's folder (and
of ``latest`` in the checkpoint folder): here a process that writes rank 1's optimizer file of
``global_step1``, and then ``latest``, through ``atomic_write``, as a rank of a save does, is
SIGKILLed in the middle of it. A 2-rank ZeRO-2 job then saves ``global_step1`` while its rank 1 is
still writing a file of its own into the tag's folder: the killed process's temporaries must be
gone, the one being written must be kept (and complete), and the new save must load. No rank writes
into the tag before the reclamation is done, even where the reclaiming rank cannot see another
node's locks.
"""

import os
import signal
import subprocess
import sys
import threading
import time

import torch

from deepspeed.checkpoint.durable import atomic_write
import deepspeed.comm as dist

from unit.checkpoint.test_checkpoint_killed_save import full_weights, initialize, train_step
from unit.common import DistributedTest

KILLED_SAVE = """
import os, signal, sys
from deepspeed.checkpoint.durable import atomic_write
rank_file, latest = sys.argv[1:]

def write_latest(temp):
    with open(temp, "w") as fd:
        fd.write("global_step1")
    os.kill(os.getpid(), signal.SIGKILL)

def write_rank_file(temp):
    with open(temp, "wb") as fd:
        fd.write(b"half a rank file")
    atomic_write(latest, write_latest)

atomic_write(rank_file, write_rank_file)
"""


def temporaries(folder):
    return sorted(name for name in os.listdir(folder) if name.endswith(".tmp"))


class TestCheckpointReclaimTemps(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test_next_save_of_the_tag_removes_what_a_killed_save_left(self, tmpdir):
        save_dir = str(tmpdir)
        folder = os.path.join(save_dir, "global_step1")
        engine = initialize(2)
        train_step(engine)
        if dist.get_rank() == 0:
            os.makedirs(folder)
            rank_file = os.path.join(folder, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
            killed = subprocess.run([sys.executable, "-c", KILLED_SAVE, rank_file, os.path.join(save_dir, "latest")])
            assert killed.returncode == -signal.SIGKILL
            assert len(temporaries(folder)) == 1 and len(temporaries(save_dir)) == 1
        dist.barrier()

        # Another process (rank 1) writes a file into the tag's folder while rank 0 saves the tag.
        writing, done = threading.Event(), threading.Event()

        def write_notes(temp):
            with open(temp, "w") as fd:
                fd.write("written while the tag was saved")
            writing.set()
            done.wait()

        if dist.get_rank() == 1:
            writer = threading.Thread(target=atomic_write, args=(os.path.join(folder, "notes.txt"), write_notes))
            writer.start()
            writing.wait()
        dist.barrier()
        engine.save_checkpoint(save_dir, tag="global_step1")
        if dist.get_rank() == 0:
            left = temporaries(folder)
            assert len(left) == 1 and left[0].startswith(".notes.txt."), left
            assert temporaries(save_dir) == []
        dist.barrier()
        if dist.get_rank() == 1:
            done.set()
            writer.join()
        dist.barrier()

        assert temporaries(folder) == []
        with open(os.path.join(folder, "notes.txt")) as fd:
            assert fd.read() == "written while the tag was saved"
        load_path, _ = initialize(2).load_checkpoint(save_dir)
        assert os.path.basename(os.path.dirname(load_path)) == "global_step1", load_path


class TestReclaimBeforeWriting(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test_live_write_survives_a_lock_the_reclaiming_rank_cannot_see(self, tmpdir):
        """Where ``flock`` is local to a node (NFS mounted ``nolock``, Lustre ``localflock``), the rank
        that reclaims a tag's temporaries cannot see the locks of other nodes' writers: no rank may
        write into the tag before the reclamation is done."""
        from deepspeed.checkpoint import durable
        save_dir = str(tmpdir)
        engine = initialize(2)
        train_step(engine)
        engine.save_checkpoint(save_dir, tag="checkpoint")
        train_step(engine)
        real_lock, real_makedirs, real_save = durable._lock, engine.checkpoint_engine.makedirs, torch.save

        def slow_makedirs(*args, **kwargs):
            # Rank 0 reclaims the tag's temporaries right after it makes sure the tag's folder exists.
            time.sleep(1)
            real_makedirs(*args, **kwargs)

        def slow_save(obj, f, *args, **kwargs):
            real_save(obj, f, *args, **kwargs)
            time.sleep(2)

        if dist.get_rank() == 0:
            durable._lock = lambda fd, blocking: True  # every other writer's lock unseen
            engine.checkpoint_engine.makedirs = slow_makedirs
        else:
            torch.save = slow_save
        try:
            engine.save_checkpoint(save_dir, tag="checkpoint")
        finally:
            durable._lock, engine.checkpoint_engine.makedirs, torch.save = real_lock, real_makedirs, real_save
        weights = full_weights(engine)
        fresh = initialize(2)
        fresh.load_checkpoint(save_dir)
        loaded = full_weights(fresh)
        for name, tensor in weights.items():
            assert torch.equal(loaded[name], tensor), name
