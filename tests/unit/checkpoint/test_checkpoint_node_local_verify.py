# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""With node-local storage every node reads copies of its own, so every node verifies its own copies.

Two nodes of one rank each (on this machine, each in a working folder of its own) save a ZeRO-2
checkpoint to their own disks with ``"use_node_local_storage": true``. The whole checkpoint is then
staged onto each node's disk, as a job does to resume at another topology, and one bit is flipped in
the second node's copy of the first rank's optimizer file. A job that loads it at ZeRO-3, where the
ranks share the files to verify between them, must refuse it on both nodes, naming the file, with
the weights unchanged. Before, the first node verified its own copy of that file for every rank,
and the second node loaded its bad copy unchecked.

This file is also the job: ``python -m torch.distributed.run ... test_checkpoint_node_local_verify.py``.
"""

import os
import shutil
import subprocess
import sys

import torch

from unit.checkpoint.test_checkpoint_crc32 import flip_bit
from unit.checkpoint.test_checkpoint_killed_save import full_weights, initialize, say, train_step

CHANGED = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def run_nodes(tmp_path, mode):
    from unit.common import get_master_port
    port = get_master_port()
    tests_dir = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")])))
    nodes = []
    for node_rank in range(2):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node_rank}",
            "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}", __file__, mode
        ]
        nodes.append(
            subprocess.Popen(command,
                             cwd=tmp_path / f"node{node_rank}",
                             env=env,
                             stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT,
                             text=True))
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output
    return outputs


def test_each_node_verifies_its_own_copies(tmp_path):
    tags = [tmp_path / f"node{node_rank}" / "ckpt" / "step1" for node_rank in range(2)]
    for tag in tags:
        tag.parent.parent.mkdir()
    run_nodes(tmp_path, "save")
    # Every node's disk gets the whole checkpoint.
    for source, target in ((tags[0], tags[1]), (tags[1], tags[0])):
        for name in os.listdir(source):
            if not os.path.exists(target / name):
                shutil.copy2(source / name, target / name)
    flip_bit(str(tags[1] / CHANGED))

    outputs = run_nodes(tmp_path, "load")
    for node_rank, output in enumerate(outputs):
        assert f"rank {node_rank}: refused: " in output, output
        refusal = next(line for line in output.splitlines() if f"rank {node_rank}: refused: " in line)
        assert f"ckpt/step1/{CHANGED} (record " in refusal and "fails its CRC-32 check" in refusal, refusal


# The job, on every node.


def save():
    engine = initialize(2, node_local=True)
    train_step(engine)
    # A relative path: each node's working folder is its own disk.
    engine.save_checkpoint("ckpt", tag="step1")


def load(tag="step1", universal=False):
    import deepspeed.comm as dist
    engine = initialize(3, node_local=True, load_universal=universal)
    weights = full_weights(engine)
    try:
        engine.load_checkpoint("ckpt", tag=tag)
    except ValueError as err:
        say(f"rank {dist.get_rank()}: refused: {err}")
    else:
        say(f"rank {dist.get_rank()}: loaded")
    actual = full_weights(engine)
    for name, tensor in weights.items():
        assert torch.equal(actual[name], tensor), name


if __name__ == "__main__":
    import deepspeed
    import deepspeed.comm as dist
    deepspeed.init_distributed()
    if sys.argv[1] == "save":
        save()
    elif sys.argv[1] == "load-universal":
        load("universal", universal=True)
    else:
        load()
    dist.barrier()
    dist.destroy_process_group()
