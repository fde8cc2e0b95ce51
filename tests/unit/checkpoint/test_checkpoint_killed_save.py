# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A save that is killed half way never becomes the checkpoint a restart resumes from.

A 2-rank job trains a small Llama at ZeRO stage 1, 2 or 3, saves ``global_step1``, trains on and
saves ``global_step2``, during which rank 1 is SIGKILLed in the middle of writing its optimizer file
(after the other rank has finished its own files). The launcher then tears the job down, as it does
when a node dies during a save. ``latest`` must still name ``global_step1``, no file of
``global_step2`` may be truncated under its final name, a restarted job must resume from
``global_step1`` with the weights it had when it was saved, and a load of ``global_step2`` by name
must be refused with an error that names the missing file, leaving the engine as it was. With
node-local storage (every node saves to its own disk), every node gets its own ``latest``.

This file is also the job: ``python -m torch.distributed.run ... test_checkpoint_killed_save.py``.
"""

import io
import os
import signal
import subprocess
import sys
import time
import zipfile

import pytest

STAGES = (1, 2, 3)
SEQ_LEN = 8


def run_job(*args):
    from unit.common import get_master_port
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2", "--master_addr=127.0.0.1",
        f"--master_port={get_master_port()}", __file__, *map(str, args)
    ]
    return subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)


@pytest.fixture(scope="module")
def killed_saves(tmp_path_factory):
    root = tmp_path_factory.mktemp("killed-saves")
    for stage in STAGES:
        proc = run_job("save", stage, root / f"stage{stage}")
        assert "rank 1: killed while writing" in proc.stdout, proc.stdout
        assert proc.returncode != 0, proc.stdout
    return root


@pytest.mark.parametrize("stage", STAGES)
def test_latest_names_the_last_complete_checkpoint(killed_saves, stage):
    with open(killed_saves / f"stage{stage}" / "latest") as fd:
        assert fd.read() == "global_step1"


@pytest.mark.parametrize("stage", STAGES)
def test_no_truncated_file_under_a_final_name(killed_saves, stage):
    folder = killed_saves / f"stage{stage}" / "global_step2"
    for name in os.listdir(folder):
        if name.endswith(".pt"):
            assert zipfile.is_zipfile(folder / name), f"{name} is truncated"


@pytest.fixture(scope="module")
def restarted(killed_saves):
    proc = run_job("load", *(killed_saves / f"stage{stage}" for stage in STAGES))
    assert proc.returncode == 0, proc.stdout
    return proc.stdout


def test_restart_resumes_from_the_last_complete_checkpoint(restarted):
    assert restarted.count("resumed from global_step1") == 2 * len(STAGES), restarted


def test_load_of_the_killed_tag_names_its_missing_file(restarted):
    refusals = [line for line in restarted.splitlines() if "refused global_step2" in line]
    assert len(refusals) == 2 * len(STAGES), restarted
    for line in refusals:
        assert "Checkpoint 'global_step2'" in line, line
        assert "global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt (missing)" in line, line


def test_every_node_resumes_from_its_own_latest(tmp_path):
    """``"use_node_local_storage": true``: each node saves to its own disk, so each needs its own
    ``latest``. Two nodes of one rank each, on this machine, each in its own working folder."""
    from unit.common import get_master_port
    port = get_master_port()
    nodes = []
    for node_rank in range(2):
        folder = tmp_path / f"node{node_rank}"
        folder.mkdir()
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node_rank}",
            "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}", __file__, "node-local"
        ]
        nodes.append(subprocess.Popen(command, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    for node_rank, (node, output) in enumerate(zip(nodes, outputs)):
        assert node.returncode == 0, output
        with open(tmp_path / f"node{node_rank}" / "ckpt" / "latest") as fd:
            assert fd.read() == "global_step1"
        assert f"rank {node_rank}: resumed from global_step1 on its node" in output, output


# The job, on every rank.


def say(line):
    """One line of output in one write: both ranks share the launcher's stdout, and print() writes the
    line and its newline separately, so two ranks' lines could run together."""
    sys.stdout.write(f"{line}\n")
    sys.stdout.flush()


def initialize(stage, node_local=False, fsync=True, bf16=False, mpu=None, **checkpoint_config):
    import torch
    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(42)
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=64,
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    max_position_embeddings=SEQ_LEN))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-2,
                "torch_adam": True
            }
        },
        "zero_optimization": {
            "stage": stage
        },
        "bf16": {
            "enabled": bf16
        },
        "checkpoint": {
            "use_node_local_storage": node_local,
            "fsync": fsync,
            **checkpoint_config
        },
    }
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters(), mpu=mpu)
    return engine


def train_step(engine):
    import torch
    import deepspeed.comm as dist
    generator = torch.Generator().manual_seed(engine.global_steps * dist.get_world_size() + dist.get_rank())
    ids = torch.randint(0, 64, (2, SEQ_LEN), generator=generator)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()


def full_weights(engine):
    import deepspeed
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: param.detach().cpu().clone() for name, param in params.items()}


def die_while_writing_optimizer_states():
    """Make torch.save SIGKILL this process half way through writing an optimizer file, once the other
    ranks have had the time to finish their part of the save."""
    import torch
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        # f: a path, or a file opened for writing.
        path = os.fspath(getattr(f, "name", f))
        if "optim_states.pt" not in path:
            return real_save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        time.sleep(2)
        with open(path, "ab") as out:
            out.truncate(0)
            out.write(buffer.getbuffer()[:buffer.tell() // 2])
        say(f"rank 1: killed while writing {path}")
        os.kill(os.getpid(), signal.SIGKILL)

    torch.save = save


def save_then_die(stage, save_dir):
    import torch
    import deepspeed.comm as dist
    engine = initialize(stage)
    train_step(engine)
    engine.save_checkpoint(save_dir, tag="global_step1")
    weights = full_weights(engine)
    if dist.get_rank() == 0:
        torch.save(weights, os.path.join(save_dir, "global_step1_weights.pt"))
    train_step(engine)
    if dist.get_rank() == 1:
        die_while_writing_optimizer_states()
    engine.save_checkpoint(save_dir, tag="global_step2")


def resume(save_dir):
    import torch
    import deepspeed.comm as dist
    engine = initialize(int(os.path.basename(save_dir).removeprefix("stage")))
    load_path, _ = engine.load_checkpoint(save_dir)
    assert os.path.basename(os.path.dirname(load_path)) == "global_step1", load_path
    expected = torch.load(os.path.join(save_dir, "global_step1_weights.pt"))
    actual = full_weights(engine)
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name
    train_step(engine)
    say(f"rank {dist.get_rank()}: resumed from global_step1")

    # The killed save's tag is refused by name, before anything is loaded.
    weights = full_weights(engine)
    try:
        engine.load_checkpoint(save_dir, tag="global_step2")
    except ValueError as err:
        say(f"rank {dist.get_rank()}: refused global_step2: {err}")
    else:
        raise AssertionError("the incomplete global_step2 was loaded")
    actual = full_weights(engine)
    for name, tensor in weights.items():
        assert torch.equal(actual[name], tensor), name


def save_and_resume_on_each_node():
    import torch
    import deepspeed.comm as dist
    engine = initialize(2, node_local=True)
    train_step(engine)
    # A relative path: each node's working folder is its own disk.
    engine.save_checkpoint("ckpt", tag="global_step1")
    weights = full_weights(engine)
    fresh = initialize(2, node_local=True)
    load_path, _ = fresh.load_checkpoint("ckpt")
    assert load_path is not None, "no latest on this node"
    assert os.path.basename(os.path.dirname(load_path)) == "global_step1", load_path
    actual = full_weights(fresh)
    for name, tensor in weights.items():
        assert torch.equal(actual[name], tensor), name
    say(f"rank {dist.get_rank()}: resumed from global_step1 on its node")


if __name__ == "__main__":
    import deepspeed
    import deepspeed.comm as dist
    deepspeed.init_distributed()
    if sys.argv[1] == "save":
        save_then_die(int(sys.argv[2]), sys.argv[3])
    elif sys.argv[1] == "node-local":
        save_and_resume_on_each_node()
        dist.barrier()
        dist.destroy_process_group()
    else:
        for save_dir in sys.argv[2:]:
            resume(save_dir)
        # Left to the interpreter's exit, a rank can abort in teardown ("terminate called without an
        # active exception") after it has finished.
        dist.barrier()
        dist.destroy_process_group()
