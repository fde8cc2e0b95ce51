# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The optimizer states that ZeRO-3 offloads to NVMe are saved like every other checkpoint file.

Each rank copies its swap files into ``<tag>/offloaded_tensors/rank<N>/``. That folder appears only
complete and flushed, and the tag's record (``checkpoint_manifest.json``) holds the size and CRC-32
of every file in it, so that ``load_checkpoint`` refuses, by name and before anything is loaded, a
tag whose save was killed while copying them, and a recorded tag one of whose offloaded files is
missing or changed. A complete save, of a new tag or of one saved before, loads exactly: the weights, and
the offloaded states that the next step reads.

This file is also the job that is killed: ``python -m torch.distributed.run ... test_checkpoint_nvme_offload.py``.
"""

import builtins
import os
import signal
import subprocess
import sys

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.ops.op_builder import AsyncIOBuilder

from unit.checkpoint.test_checkpoint_weights_only import assert_weights_equal, full_weights
from unit.common import DistributedTest, get_master_port

if not deepspeed.ops.__compatible_ops__[AsyncIOBuilder.NAME]:
    pytest.skip(
        "NVMe offload needs DeepSpeed's async_io op, which cannot be built here (it needs libaio: "
        "apt-get install libaio-dev)",
        allow_module_level=True)


def initialize(nvme_path):
    torch.manual_seed(42)
    # At least 1 MiB of fp32 states per rank: smaller states are kept in memory, not swapped out.
    model = torch.nn.Sequential(torch.nn.Linear(8, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-2
            }
        },
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": str(nvme_path)
            }
        },
    }
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    return engine


def train_step(engine):
    generator = torch.Generator().manual_seed(engine.global_steps * dist.get_world_size() + dist.get_rank())
    engine.backward(engine(torch.randn(2, 8, generator=generator)).square().mean())
    engine.step()


def swapped_states(engine):
    folder = engine.optimizer.optimizer_swapper.swap_folder
    states = {}
    for name in os.listdir(folder):
        if "gradient" not in name:
            with open(os.path.join(folder, name), "rb") as fd:
                states[name] = fd.read()
    assert states
    return states


def offloaded_file(save_dir, tag, rank, prefix):
    folder = os.path.join(save_dir, tag, "offloaded_tensors", f"rank{rank:02d}")
    names = [name for name in sorted(os.listdir(folder)) if name.startswith(prefix)]
    assert names, os.listdir(folder)
    return os.path.join(folder, names[0])


class TestNVMeOffloadedTensors(DistributedTest):
    world_size = 2

    def test_complete_save_loads_exactly(self, tmpdir):
        engine = initialize(tmpdir / "swap")
        train_step(engine)
        engine.save_checkpoint(str(tmpdir / "ckpt"), tag="t1")
        train_step(engine)
        # The tag saved again (a script's "last"): its offloaded folder is replaced.
        engine.save_checkpoint(str(tmpdir / "ckpt"), tag="t1")
        saved, states = full_weights(engine), swapped_states(engine)
        train_step(engine)
        assert swapped_states(engine) != states

        engine.load_checkpoint(str(tmpdir / "ckpt"))
        assert_weights_equal(engine, saved)
        # The fp32 weights and Adam's moments that the next step reads from NVMe are those saved.
        assert swapped_states(engine) == states

    def test_changed_or_missing_offloaded_file_is_refused_by_name(self, tmpdir):
        save_dir = str(tmpdir / "ckpt")
        engine = initialize(tmpdir / "swap")
        train_step(engine)
        engine.save_checkpoint(save_dir, tag="t1")
        train_step(engine)
        weights = full_weights(engine)

        changed = offloaded_file(save_dir, "t1", 1, "exp_avg-")
        if dist.get_rank() == 1:
            with open(changed, "r+b") as fd:
                fd.seek(4096)
                byte = fd.read(1)
                fd.seek(4096)
                fd.write(bytes([byte[0] ^ 1]))
        dist.barrier()
        with pytest.raises(ValueError, match=f"{changed} \\(not the file that the tag's last save wrote"):
            engine.load_checkpoint(save_dir, tag="t1")
        assert_weights_equal(engine, weights)

        dist.barrier()
        if dist.get_rank() == 1:
            os.remove(changed)
        dist.barrier()
        with pytest.raises(ValueError, match=f"{changed} \\(missing\\)"):
            engine.load_checkpoint(save_dir, tag="t1")
        assert_weights_equal(engine, weights)


class TestKilledNVMeOffloadSave(DistributedTest):
    world_size = 1

    def test_killed_tag_never_loads_partly(self, tmpdir):
        """A 1-rank job saves ``t1``, trains a step and saves ``t2``, and is SIGKILLed while it copies its
        second offloaded file into ``t2``."""
        save_dir = str(tmpdir / "ckpt")
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=1",
            "--master_addr=127.0.0.1", f"--master_port={get_master_port()}", __file__, save_dir,
            str(tmpdir / "job-swap")
        ]
        # The job imports this file, and with it unit.common.
        tests = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
        job = subprocess.run(command,
                             stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT,
                             text=True,
                             timeout=600,
                             env=env)
        assert "killed while copying" in job.stdout and job.returncode != 0, job.stdout
        with open(os.path.join(save_dir, "latest")) as fd:
            assert fd.read() == "t1"

        engine = initialize(tmpdir / "swap")
        engine.load_checkpoint(save_dir)
        assert_weights_equal(engine, torch.load(os.path.join(save_dir, "t1_weights.pt")))
        train_step(engine)
        weights = full_weights(engine)
        with pytest.raises(ValueError,
                           match=f"{os.path.join(save_dir, 't2', 'offloaded_tensors', 'rank00')} "
                           "\\(missing\\)"):
            engine.load_checkpoint(save_dir, tag="t2")
        assert_weights_equal(engine, weights)


def die_while_copying_offloaded_tensors():
    """SIGKILL this process when it opens its second offloaded file in the tag for writing, with a part of
    it written: the first one is complete by then."""
    real_open, opened = builtins.open, []

    def open_then_die(file, mode="r", *args, **kwargs):
        if "offloaded_tensors" not in os.fspath(file) or "w" not in mode:
            return real_open(file, mode, *args, **kwargs)
        opened.append(file)
        if len(opened) < 2:
            return real_open(file, mode, *args, **kwargs)
        with real_open(file, mode, *args, **kwargs) as fd:
            fd.write(bytes(4096))
        sys.stdout.write(f"killed while copying {file}\n")
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    builtins.open = open_then_die


if __name__ == "__main__":
    deepspeed.init_distributed()
    save_dir, nvme_path = sys.argv[1:]
    engine = initialize(nvme_path)
    train_step(engine)
    engine.save_checkpoint(save_dir, tag="t1")
    torch.save(full_weights(engine), os.path.join(save_dir, "t1_weights.pt"))
    train_step(engine)
    die_while_copying_offloaded_tensors()
    engine.save_checkpoint(save_dir, tag="t2")
