# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A tag saved again is loaded whole or refused: files of two saves are never loaded together.

PyTorch Lightning's DeepSpeed strategy saves every checkpoint under the tag ``checkpoint`` (its
``last.ckpt`` is saved again and again), and many scripts keep one tag such as ``last``. A 2-rank
job saves the tag that ``latest`` names again, and rank 0 is SIGKILLed at its first rename of a file
of that save, once rank 1 has renamed its new optimizer file into the tag: the next job's
``load_checkpoint`` must refuse the tag on every rank, naming the save that did not finish, with the
engine's weights unchanged, at ZeRO-2 and ZeRO-3. A tag saved again to the end loads its last save.

This file is also the job: ``python -m torch.distributed.run ... test_checkpoint_killed_resave.py``.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import deepspeed.comm as dist

from unit.checkpoint.test_checkpoint_killed_save import full_weights, initialize, say, train_step
from unit.common import DistributedTest

STAGES = (2, 3)
OTHER_RANKS_OPTIMIZER_FILE = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
# Where a save of a tag records that it began.
MANIFEST = "checkpoint_manifest.json"


def assert_same_weights(engine, expected):
    actual = full_weights(engine)
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


@pytest.mark.parametrize("stage", STAGES)
class TestTagSavedAgain(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test_tag_saved_again_loads_its_last_save(self, stage, tmpdir):
        save_dir = str(tmpdir)
        engine = initialize(stage)
        train_step(engine)
        engine.save_checkpoint(save_dir, tag="checkpoint")
        train_step(engine)
        engine.save_checkpoint(save_dir, tag="checkpoint")
        weights = full_weights(engine)

        fresh = initialize(stage)
        fresh.load_checkpoint(save_dir)
        assert_same_weights(fresh, weights)
        assert fresh.global_steps == engine.global_steps


def run_job(job, *args):
    """Run the file ``job`` on 2 ranks with ``args``."""
    from unit.common import get_master_port
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2", "--master_addr=127.0.0.1",
        f"--master_port={get_master_port()}", job, *map(str, args)
    ]
    tests_dir = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")])))
    return subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)


@pytest.fixture(scope="module")
def killed_resaves(tmp_path_factory):
    root = tmp_path_factory.mktemp("killed-resaves")
    save_dirs = [root / f"stage{stage}" for stage in STAGES]
    for stage, save_dir in zip(STAGES, save_dirs):
        proc = run_job(__file__, "save", stage, save_dir)
        assert f"rank 0: killed at its first rename, after rank 1 renamed {OTHER_RANKS_OPTIMIZER_FILE}" in proc.stdout, \
            proc.stdout
        assert proc.returncode != 0, proc.stdout
    proc = run_job(__file__, "load", *save_dirs)
    assert proc.returncode == 0, proc.stdout
    return save_dirs, proc.stdout


@pytest.mark.parametrize("index", range(len(STAGES)))
def test_rank_killed_while_the_tag_is_saved_again(killed_resaves, index):
    save_dirs, output = killed_resaves
    save_dir = str(save_dirs[index])
    assert (save_dirs[index] / "latest").read_text() == "checkpoint"
    refusals = [line for line in output.splitlines() if line.startswith(f"{save_dir}: rank")]
    assert len(refusals) == 2, output
    manifest = os.path.join(save_dir, "checkpoint", MANIFEST)
    for line in refusals:
        assert f"refused: Checkpoint 'checkpoint', the tag that {os.path.join(save_dir, 'latest')} names," in line, line
        assert f"{manifest} (a save of this tag began and did not finish" in line, line


# The job, on every rank.


def die_at_the_first_rename_once_rank_1_renamed(folder):
    """SIGKILL this process at its first rename of a checkpoint file into ``folder``, once the other rank
    has renamed its new optimizer file there."""
    other = os.path.join(folder, OTHER_RANKS_OPTIMIZER_FILE)
    earlier = os.stat(other).st_ino
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        if os.path.dirname(os.path.abspath(dst)) == folder and str(dst).endswith(".pt"):
            deadline = time.monotonic() + 120
            while os.stat(other).st_ino == earlier and time.monotonic() < deadline:
                time.sleep(0.05)
            say(f"rank 0: killed at its first rename, after rank 1 renamed {OTHER_RANKS_OPTIMIZER_FILE}")
            os.kill(os.getpid(), signal.SIGKILL)
        return real_replace(src, dst, *args, **kwargs)

    os.replace = replace


def save_again_then_die(stage, save_dir):
    engine = initialize(stage)
    train_step(engine)
    engine.save_checkpoint(save_dir, tag="checkpoint")
    train_step(engine)
    if dist.get_rank() == 0:
        die_at_the_first_rename_once_rank_1_renamed(os.path.abspath(os.path.join(save_dir, "checkpoint")))
    engine.save_checkpoint(save_dir, tag="checkpoint")


def load_refused(save_dir):
    engine = initialize(int(os.path.basename(save_dir)[5]))
    weights = full_weights(engine)
    try:
        engine.load_checkpoint(save_dir)
    except ValueError as err:
        say(f"{save_dir}: rank {dist.get_rank()}: refused: {err}")
    else:
        say(f"{save_dir}: rank {dist.get_rank()}: loaded a tag that holds files of two saves")
    assert_same_weights(engine, weights)
    dist.barrier()


if __name__ == "__main__":
    import deepspeed
    deepspeed.init_distributed()
    if sys.argv[1] == "save":
        save_again_then_die(int(sys.argv[2]), sys.argv[3])
    else:
        for save_dir in sys.argv[2:]:
            load_refused(save_dir)
        dist.barrier()
        dist.destroy_process_group()
