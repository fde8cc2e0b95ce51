# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A checkpoint tag holds one save or is refused: files of two saves are never loaded together.

Each save records which files it wrote in the tag. A tag saved again to the end loads the last save;
a file put back from the earlier save (a copy that mixed two saves) is refused by name, by the load
and by ``ds_verify_checkpoint``, which checks a tag that records its files without unpickling
anything, so a ``client_state`` with a class of the user's passes. A background save that raised
leaves nothing for the next save to write into its tag. A 2-rank job saves the tag that ``latest``
names again in the background, and rank 0 is SIGKILLed at its first rename of a file of that save,
once rank 1 has renamed its new optimizer file into the tag: the next job's ``load_checkpoint`` must
refuse the tag on every rank, naming the save that did not finish, with the engine's weights
unchanged, and ``ds_verify_checkpoint`` must report it, at ZeRO-2 and ZeRO-3.

This file is also the job: ``python -m torch.distributed.run ... test_checkpoint_resave_tag.py``.
"""

import io
import os
import shutil
import sys
from contextlib import redirect_stdout

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.checkpoint.verify_checkpoint import main as verify_checkpoint

from unit.checkpoint.test_checkpoint_killed_resave import (MANIFEST, OTHER_RANKS_OPTIMIZER_FILE, assert_same_weights,
                                                           die_at_the_first_rename_once_rank_1_renamed, run_job)
from unit.checkpoint.test_checkpoint_killed_save import full_weights, initialize, say, train_step
from unit.common import DistributedTest

KILLED = [(2, True), (3, True)]


class RunConfig:
    """What a training script may keep in ``client_state``: a class of its own."""

    def __init__(self, name):
        self.name = name


def ds_verify_checkpoint(*args):
    output = io.StringIO()
    with redirect_stdout(output):
        returncode = verify_checkpoint(list(args))
    return returncode, output.getvalue()


@pytest.mark.parametrize("stage", [2, 3])
class TestCheckpointResaveTag(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test_tag_saved_again_loads_its_last_save(self, stage, tmpdir):
        save_dir = str(tmpdir)
        engine = initialize(stage)
        train_step(engine)
        engine.save_checkpoint(save_dir, tag="checkpoint", client_state={"config": RunConfig("run")})
        train_step(engine)
        engine.save_checkpoint(save_dir, tag="checkpoint", client_state={"config": RunConfig("run")})
        weights = full_weights(engine)

        fresh = initialize(stage)
        torch.serialization.add_safe_globals([RunConfig])
        load_path, client_state = fresh.load_checkpoint(save_dir)
        assert client_state["config"].name == "run"
        assert_same_weights(fresh, weights)
        assert fresh.global_steps == engine.global_steps
        dist.barrier()
        if dist.get_rank() == 0:
            # Nothing is unpickled to learn the topology: the user's class needs no admission.
            torch.serialization.clear_safe_globals()
            returncode, output = ds_verify_checkpoint(save_dir)
            assert returncode == 0 and output.startswith(f"checkpoint: OK, {3 if stage == 2 else 4} files"), output
        dist.barrier()

    def test_file_of_an_earlier_save_is_refused(self, stage, tmpdir):
        save_dir = str(tmpdir)
        folder = os.path.join(save_dir, "checkpoint")
        engine = initialize(stage)
        train_step(engine)
        engine.save_checkpoint(save_dir, tag="checkpoint")
        if dist.get_rank() == 1:
            shutil.copy(os.path.join(folder, OTHER_RANKS_OPTIMIZER_FILE), str(tmpdir.join("earlier")))
        train_step(engine)
        engine.save_checkpoint(save_dir, tag="checkpoint")
        # A copy that put one file of the earlier save back.
        if dist.get_rank() == 1:
            shutil.copy(str(tmpdir.join("earlier")), os.path.join(folder, OTHER_RANKS_OPTIMIZER_FILE))
        dist.barrier()

        fresh = initialize(stage)
        weights = full_weights(fresh)
        with pytest.raises(ValueError) as refusal:
            fresh.load_checkpoint(save_dir)
        assert (f"{os.path.join(folder, OTHER_RANKS_OPTIMIZER_FILE)} (not the file that the tag's last save wrote"
                in str(refusal.value)), refusal.value
        assert_same_weights(fresh, weights)
        if dist.get_rank() == 0:
            returncode, output = ds_verify_checkpoint(save_dir)
            assert returncode == 1 and OTHER_RANKS_OPTIMIZER_FILE in output, output
        dist.barrier()


class TestFailedBackgroundSave(DistributedTest):
    world_size = 1
    reuse_dist_env = True

    def test_next_save_writes_nothing_of_a_save_that_raised(self, tmpdir):
        """A background save that raises after it staged some files (here the optimizer file's host
        copy fails) leaves nothing that the next save writes into the failed tag's folder."""
        save_dir = str(tmpdir)
        engine = initialize(2, async_save=True)
        train_step(engine)
        real_host_copy = engine.checkpoint_engine._host_copy

        def host_copy(state_dict, path):
            if path.endswith("optim_states.pt"):
                raise MemoryError("no host memory left for the copy")
            return real_host_copy(state_dict, path)

        engine.checkpoint_engine._host_copy = host_copy
        with pytest.raises(MemoryError):
            engine.save_checkpoint(save_dir, tag="failed")
        engine.checkpoint_engine._host_copy = real_host_copy
        train_step(engine)
        engine.save_checkpoint(save_dir, tag="next")
        engine.wait_for_async_save()
        assert [name for name in os.listdir(os.path.join(save_dir, "failed")) if not name.startswith(".")] == []
        assert (tmpdir / "latest").read() == "next"
        engine.destroy()


@pytest.fixture(scope="module")
def killed_resaves(tmp_path_factory):
    root = tmp_path_factory.mktemp("killed-resaves")
    save_dirs = [root / f"stage{stage}{'-async' if async_save else ''}" for stage, async_save in KILLED]
    for (stage, async_save), save_dir in zip(KILLED, save_dirs):
        proc = run_job(__file__, "save", stage, int(async_save), save_dir)
        assert f"rank 0: killed at its first rename, after rank 1 renamed {OTHER_RANKS_OPTIMIZER_FILE}" in proc.stdout, \
            proc.stdout
        assert proc.returncode != 0, proc.stdout
    proc = run_job(__file__, "load", *save_dirs)
    assert proc.returncode == 0, proc.stdout
    return save_dirs, proc.stdout


@pytest.mark.parametrize("index", range(len(KILLED)))
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
    assert f"{save_dir}: ds_verify_checkpoint exited 1: checkpoint: FAILED: {manifest} (a save" in output, output


# The job, on every rank.


def save_again_then_die(stage, async_save, save_dir):
    engine = initialize(stage, async_save=async_save)
    train_step(engine)
    engine.save_checkpoint(save_dir, tag="checkpoint")
    engine.wait_for_async_save()
    train_step(engine)
    if dist.get_rank() == 0:
        die_at_the_first_rename_once_rank_1_renamed(os.path.abspath(os.path.join(save_dir, "checkpoint")))
    engine.save_checkpoint(save_dir, tag="checkpoint")
    engine.wait_for_async_save()


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
    if dist.get_rank() == 0:
        returncode, output = ds_verify_checkpoint(save_dir)
        say(f"{save_dir}: ds_verify_checkpoint exited {returncode}: {output}")
    dist.barrier()


if __name__ == "__main__":
    import deepspeed
    deepspeed.init_distributed()
    if sys.argv[1] == "save":
        save_again_then_die(int(sys.argv[2]), bool(int(sys.argv[3])), sys.argv[4])
    else:
        for save_dir in sys.argv[2:]:
            load_refused(save_dir)
        dist.barrier()
        dist.destroy_process_group()
