# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A gloo job that leaves its process group to the interpreter's exit ends with status 0.

Left to the interpreter's teardown, gloo's worker threads can still hold the last collective's work
when Python is gone, and now and then a process aborts after its job finished ("terminate called without
an active exception", exit status 134). ``init_distributed`` destroys the process group it created
at exit, before the teardown, and leaves a process group that the script created alone.
"""

import os
import subprocess
import sys

import pytest

from unit.common import get_master_port

JOB = """
import atexit, sys
import torch
import deepspeed
import deepspeed.comm as dist

def at_exit():
    alive = torch.distributed.is_initialized()
    print(f"rank {rank}: process group alive at teardown: {alive}")
    if alive:
        torch.distributed.destroy_process_group()


# Registered before DeepSpeed's own exit handlers, so it runs after them.
atexit.register(at_exit)
if sys.argv[-1] == "script":
    torch.distributed.init_process_group("gloo")
deepspeed.init_distributed(dist_backend="gloo")
rank = dist.get_rank()
x = torch.ones(1 << 16)
for _ in range(4):
    dist.all_reduce(x)
dist.barrier()
"""


def run_job(tmpdir, created_by):
    script = tmpdir.join("job.py")
    script.write(JOB)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2", "--master_addr=127.0.0.1",
        f"--master_port={get_master_port()}",
        str(script), created_by
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)


@pytest.mark.parametrize("created_by, alive", [("deepspeed", False), ("script", True)])
def test_process_group_destroyed_at_exit_by_its_creator(tmpdir, created_by, alive):
    proc = run_job(tmpdir, created_by)
    assert proc.returncode == 0, proc.stdout
    for rank in range(2):
        assert f"rank {rank}: process group alive at teardown: {alive}" in proc.stdout, proc.stdout
