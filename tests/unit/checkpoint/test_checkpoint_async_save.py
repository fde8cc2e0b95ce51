# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``save_checkpoint`` with ``"checkpoint": {"async_save": true}`` returns once every rank holds a
host copy of what it saves, and writes the files in the background.

A 2-rank job at ZeRO-2 and ZeRO-3 saves in the background and takes a step right after the call
returns, before the files are written: what it wrote must be what a synchronous save of the same
state writes, file by file and tensor by tensor, and `latest` must name the tag once that step
returns: the next optimizer step waits for the save, so that a framework that removes the last
checkpoint folder before its next save finds it complete. So must a job of one rank at ZeRO-1 in
bf16, a 2-rank ZeRO-0 job in bf16 and a 2-rank ZeRO-1 job with a Megatron-style ``mpu`` of
tensor-parallel size 2. A write that fails on one rank (a folder in the way of its optimizer file)
must be raised on every rank at the next save, naming the tag, the rank and the cause, with `latest`
left on the last complete tag; the save after that works.

A rank SIGKILLed half way through writing its optimizer file in the background, while training
goes on, must leave `latest` on the previous tag and no truncated file under a final name, and the
next job resumes from the previous tag. A script whose last background save fails and that then
ends must exit with an error naming the tag and the cause. A 2-rank script that destroys the process
group right after its last save, as accelerate's ``end_training()`` does, must exit 0 with `latest`
naming that save. This file is also those jobs: ``python -m torch.distributed.run ...
test_checkpoint_async_save.py save STAGE DIR`` (or ``exit DIR``, ``destroy DIR``).

The machinery itself: the background commit talks through the job's own store, and a save opens no
port of its own (before, rank 0 served a store of its own on a second port, on every interface). A
commit that fails on rank 0 (a folder in the way of `latest`) is raised on every rank by the next
``wait_for_async_save()``, at once, and the next save and load work (before, the other rank waited
for the store's timeout, and later saves failed). A failure raised by the next optimizer step leaves
the step complete. ``save_16bit_model()`` while a background save writes is not part of that save:
the tag loads (before, it reset the save's record of its files, and the tag was refused).
"""

import os
import re
import subprocess
import sys
import threading
import zipfile

import pytest
import torch

import deepspeed.comm as dist

from unit.checkpoint import test_checkpoint_killed_save as killed_save
from unit.checkpoint.test_checkpoint_killed_save import initialize, train_step
from unit.common import DistributedTest


def assert_same(saved, expected, where):
    if isinstance(expected, torch.Tensor):
        assert isinstance(saved, torch.Tensor) and saved.dtype == expected.dtype, where
        assert torch.equal(saved, expected), where
    elif isinstance(expected, dict):
        assert sorted(saved, key=str) == sorted(expected, key=str), where
        for key, value in expected.items():
            assert_same(saved[key], value, f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(saved) == len(expected), where
        for index, value in enumerate(expected):
            assert_same(saved[index], value, f"{where}[{index}]")
    elif hasattr(expected, "__dict__"):
        # Objects such as the loss scaler compare by their state.
        assert type(saved) is type(expected), where
        assert_same(vars(saved), vars(expected), where)
    else:
        assert saved == expected, where


def assert_same_checkpoint_as_a_synchronous_save(save_dir, stage, **job):
    engine = initialize(stage, **job)
    train_step(engine)
    engine.save_checkpoint(save_dir, tag="sync")
    engine.destroy()

    engine = initialize(stage, async_save=True, **job)
    train_step(engine)
    # Training goes on while the files are written: the save must not see the next step, whose
    # weights are updated before the background writes begin (the step then waits for the save).
    step_taken, real_save, training = threading.Event(), torch.save, threading.current_thread()
    wait_for_async_save = engine.wait_for_async_save

    def save_after_the_step(*args, **kwargs):
        if threading.current_thread() is not training:
            step_taken.wait()
        return real_save(*args, **kwargs)

    def wait_after_the_step():
        step_taken.set()
        wait_for_async_save()

    torch.save = save_after_the_step
    try:
        engine.save_checkpoint(save_dir, tag="async")
        engine.wait_for_async_save = wait_after_the_step
        train_step(engine)
    finally:
        step_taken.set()
        torch.save = real_save
        del engine.wait_for_async_save
    with open(os.path.join(save_dir, "latest")) as fd:
        assert fd.read() == "async"
    engine.destroy()
    return assert_same_files(save_dir, "sync", "async")


def assert_same_files(save_dir, expected_tag, tag):
    """The files of ``tag``, saved in the background, hold what those of ``expected_tag``, saved
    synchronously, hold, tensor by tensor, but for the async settings of the config; returns their names."""
    names = sorted(name for name in os.listdir(os.path.join(save_dir, expected_tag)) if name.endswith(".pt"))
    assert names == sorted(name for name in os.listdir(os.path.join(save_dir, tag)) if name.endswith(".pt"))
    if dist.get_rank() == 0:
        for name in names:
            expected = torch.load(os.path.join(save_dir, expected_tag, name), weights_only=False)
            saved = torch.load(os.path.join(save_dir, tag, name), weights_only=False)
            # The config the job ran with, the one thing that differs.
            if "ds_config" in expected:
                config = saved.pop("ds_config")
                assert config["checkpoint"].pop("async_save") is True
                config["checkpoint"].pop("async_save_wait", None)
                assert_same(config, expected.pop("ds_config"), name)
            assert_same(saved, expected, name)
    return names


class ModelParallelUnit:
    """A Megatron-style ``mpu``: tensor-parallel size 2, data-parallel size 1, at world size 2. Each
    rank saves a model and an optimizer file of its own (``mp_rank_00``, ``mp_rank_01``)."""

    def __init__(self):
        self.model_group = dist.new_group([0, 1])
        self.data_groups = [dist.new_group([rank]) for rank in range(2)]

    def get_model_parallel_rank(self):
        return dist.get_rank()

    def get_model_parallel_world_size(self):
        return 2

    def get_model_parallel_group(self):
        return self.model_group

    def get_data_parallel_rank(self):
        return 0

    def get_data_parallel_world_size(self):
        return 1

    def get_data_parallel_group(self):
        return self.data_groups[dist.get_rank()]


@pytest.mark.parametrize("stage", [2, 3])
class TestCheckpointAsyncSave(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test_same_checkpoint_as_a_synchronous_save(self, stage, tmpdir):
        assert_same_checkpoint_as_a_synchronous_save(str(tmpdir), stage)

    def test_failed_write_is_raised_on_every_rank(self, stage, tmpdir):
        save_dir = str(tmpdir)
        engine = initialize(stage, async_save=True)
        train_step(engine)
        engine.save_checkpoint(save_dir, tag="step1")
        # Rank 1's optimizer file of the next tag cannot be written: a folder holds its name.
        if dist.get_rank() == 1:
            os.makedirs(os.path.join(save_dir, "step2", "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
        train_step(engine)
        engine.save_checkpoint(save_dir, tag="step2")

        error = re.escape(f"The background save of checkpoint {os.path.join(save_dir, 'step2')} failed") + ".*" + \
            re.escape("rank 1: IsADirectoryError")
        with pytest.raises(RuntimeError, match=error):
            engine.save_checkpoint(save_dir, tag="step3")
        with open(os.path.join(save_dir, "latest")) as fd:
            assert fd.read() == "step1"
        assert not [name for name in os.listdir(os.path.join(save_dir, "step2")) if name.endswith(".tmp")]

        engine.save_checkpoint(save_dir, tag="step3")
        engine.wait_for_async_save()
        with open(os.path.join(save_dir, "latest")) as fd:
            assert fd.read() == "step3"
        engine.destroy()


class TestCheckpointAsyncSaveJobs(DistributedTest):
    """Other jobs save the same checkpoint in the background as synchronously: one rank, ZeRO-0 and
    ZeRO-1, bf16, a Megatron-style ``mpu``."""
    reuse_dist_env = True

    @pytest.mark.world_size(1)
    def test_one_rank_zero1_bf16(self, tmpdir):
        assert_same_checkpoint_as_a_synchronous_save(str(tmpdir), 1, bf16=True)

    @pytest.mark.world_size(2)
    def test_zero0_bf16(self, tmpdir):
        assert_same_checkpoint_as_a_synchronous_save(str(tmpdir), 0, bf16=True)

    @pytest.mark.world_size(2)
    def test_megatron_mpu_zero1(self, tmpdir):
        names = assert_same_checkpoint_as_a_synchronous_save(str(tmpdir), 1, mpu=ModelParallelUnit())
        assert "mp_rank_01_model_states.pt" in names, names


def listening_ports():
    """The TCP ports that this process listens on, from ``/proc``."""
    sockets = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            sockets.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fd:
            for line in list(fd)[1:]:
                fields = line.split()
                # State 0A is LISTEN; field 9 is the socket's inode.
                if fields[3] == "0A" and f"socket:[{fields[9]}]" in sockets:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


class TestCheckpointAsyncSaveMachinery(DistributedTest):
    world_size = 2
    reuse_dist_env = True
    # A rank left waiting for another fails the test in minutes, not at the store's timeout.
    exec_timeout = 180

    def test_no_port_of_its_own(self, tmpdir):
        engine = initialize(2, async_save=True)
        listening = listening_ports()
        engine.save_checkpoint(str(tmpdir), tag="step0")
        engine.wait_for_async_save()
        assert listening_ports() == listening
        engine.destroy()

    def test_failed_commit_is_raised_on_every_rank(self, tmpdir):
        save_dir = str(tmpdir)
        engine = initialize(2, async_save=True)
        train_step(engine)
        # Rank 0 commits the tag, and cannot replace `latest`: a folder holds its name.
        if dist.get_rank() == 0:
            os.makedirs(os.path.join(save_dir, "latest"))
        dist.barrier()
        engine.save_checkpoint(save_dir, tag="step1")
        with pytest.raises(RuntimeError, match=re.escape("rank 0: IsADirectoryError")):
            engine.wait_for_async_save()
        dist.barrier()
        if dist.get_rank() == 0:
            os.rmdir(os.path.join(save_dir, "latest"))
        dist.barrier()

        train_step(engine)
        engine.save_checkpoint(save_dir, tag="step2")
        expected = killed_save.full_weights(engine)
        engine.wait_for_async_save()
        with open(os.path.join(save_dir, "latest")) as fd:
            assert fd.read() == "step2"
        engine.destroy()
        fresh = initialize(2, async_save=True)
        fresh.load_checkpoint(save_dir)
        for name, tensor in killed_save.full_weights(fresh).items():
            assert torch.equal(tensor, expected[name]), name

    def test_failure_raised_by_the_next_step_leaves_it_complete(self, tmpdir):
        save_dir = str(tmpdir)
        engine = initialize(2, async_save=True)
        train_step(engine)
        if dist.get_rank() == 1:
            os.makedirs(os.path.join(save_dir, "step1", "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
        engine.save_checkpoint(save_dir, tag="step1")
        micro_steps, global_steps = engine.micro_steps, engine.global_steps
        with pytest.raises(RuntimeError, match=re.escape("rank 1: IsADirectoryError")):
            train_step(engine)
        assert (engine.micro_steps, engine.global_steps) == (micro_steps + 1, global_steps + 1)
        train_step(engine)
        assert (engine.micro_steps, engine.global_steps) == (micro_steps + 2, global_steps + 2)
        engine.destroy()

    @pytest.mark.world_size(1)
    def test_save_16bit_model_during_a_background_save(self, tmpdir):
        save_dir = str(tmpdir)
        engine = initialize(1, async_save=True)
        train_step(engine)
        engine.save_checkpoint(save_dir, tag="checkpoint")
        train_step(engine)
        expected = killed_save.full_weights(engine)
        # The writer writes the save's first file, then waits until save_16bit_model() has returned.
        first_file_written, exported = threading.Event(), threading.Event()
        real_save, training, writes = torch.save, threading.current_thread(), []

        def save(*args, **kwargs):
            if threading.current_thread() is not training:
                writes.append(args[1])
                if len(writes) == 2:
                    first_file_written.set()
                    exported.wait()
            return real_save(*args, **kwargs)

        torch.save = save
        try:
            engine.save_checkpoint(save_dir, tag="checkpoint")
            first_file_written.wait()
            engine.save_16bit_model(os.path.join(save_dir, "export"))
        finally:
            exported.set()
            torch.save = real_save
        engine.wait_for_async_save()
        engine.destroy()

        fresh = initialize(1, async_save=True)
        fresh.load_checkpoint(save_dir, tag="checkpoint")
        for name, tensor in killed_save.full_weights(fresh).items():
            assert torch.equal(tensor, expected[name]), name


def run_job(world_size, *args):
    from unit.common import get_master_port
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={world_size}",
        "--master_addr=127.0.0.1", f"--master_port={get_master_port()}", __file__, *map(str, args)
    ]
    # The job imports this file's neighbours, as the tests do.
    tests_dir = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")])))
    return subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)


def test_rank_killed_during_the_background_write(tmp_path):
    save_dir = tmp_path / "stage3"
    proc = run_job(2, "save", 3, save_dir)
    assert "rank 1: save_checkpoint returned" in proc.stdout, proc.stdout
    assert "rank 1: killed while writing" in proc.stdout, proc.stdout
    assert proc.returncode != 0, proc.stdout
    assert (save_dir / "latest").read_text() == "global_step1"
    for name in os.listdir(save_dir / "global_step2"):
        if name.endswith(".pt"):
            assert zipfile.is_zipfile(save_dir / "global_step2" / name), f"{name} is truncated"

    # The next job resumes from global_step1, and refuses global_step2 by its missing file.
    proc = killed_save.run_job("load", save_dir)
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count("resumed from global_step1") == 2, proc.stdout
    assert proc.stdout.count("refused global_step2") == 2, proc.stdout


def test_background_save_that_fails_fails_the_job_at_exit(tmp_path):
    save_dir = tmp_path / "ckpt"
    proc = run_job(1, "exit", save_dir)
    assert "save_checkpoint returned" in proc.stdout, proc.stdout
    assert f"The background save of checkpoint {save_dir / 'global_step2'} failed" in proc.stdout, proc.stdout
    assert "rank 0: IsADirectoryError" in proc.stdout, proc.stdout
    assert proc.returncode != 0, proc.stdout
    assert (save_dir / "latest").read_text() == "global_step1"


def test_process_group_destroyed_right_after_the_save(tmp_path):
    save_dir = tmp_path / "ckpt"
    proc = run_job(2, "destroy", save_dir)
    assert proc.stdout.count("process group destroyed") == 2, proc.stdout
    assert proc.returncode == 0, proc.stdout
    assert (save_dir / "latest").read_text() == "global_step1"
    assert sorted(name for name in os.listdir(save_dir / "global_step1") if name.endswith(".pt")) == [
        "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    ]


def save_then_die(stage, save_dir):
    engine = initialize(stage, async_save=True)
    train_step(engine)
    engine.save_checkpoint(save_dir, tag="global_step1")
    engine.wait_for_async_save()
    weights = killed_save.full_weights(engine)
    if dist.get_rank() == 0:
        torch.save(weights, os.path.join(save_dir, "global_step1_weights.pt"))
    train_step(engine)
    if dist.get_rank() == 1:
        killed_save.die_while_writing_optimizer_states()
    engine.save_checkpoint(save_dir, tag="global_step2")
    killed_save.say(f"rank {dist.get_rank()}: save_checkpoint returned")
    # Training goes on while the files are written; rank 1 dies in its writer thread.
    train_step(engine)
    engine.wait_for_async_save()


def fail_then_exit(save_dir):
    """The script's last save fails in the background, and the script ends without waiting for it."""
    engine = initialize(1, async_save=True)
    train_step(engine)
    engine.save_checkpoint(save_dir, tag="global_step1")
    train_step(engine)
    os.makedirs(os.path.join(save_dir, "global_step2", "mp_rank_00_model_states.pt"))
    engine.save_checkpoint(save_dir, tag="global_step2")
    killed_save.say("save_checkpoint returned")


def save_then_destroy(save_dir):
    """The script's last save, then the process group destroyed, as accelerate's end_training() does."""
    engine = initialize(2, async_save=True)
    train_step(engine)
    engine.save_checkpoint(save_dir, tag="global_step1")
    torch.distributed.destroy_process_group()
    killed_save.say(f"rank {engine.global_rank}: process group destroyed")


if __name__ == "__main__":
    import deepspeed
    deepspeed.init_distributed()
    if sys.argv[1] == "exit":
        fail_then_exit(sys.argv[2])
    elif sys.argv[1] == "destroy":
        save_then_destroy(sys.argv[2])
    else:
        save_then_die(int(sys.argv[2]), sys.argv[3])
