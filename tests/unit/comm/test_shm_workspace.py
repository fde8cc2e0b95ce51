# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The CPU shared-memory all-reduce workspace leaves nothing in /dev/shm, however a job ends.

Every rank of a CPU job whose ranks are all local creates a /dev/shm segment of about 66 MB
(csrc/cpu/comm/shm.cpp). Its name is removed once every rank has mapped the segments of all the others,
so the memory goes with the last rank that exits, even when a rank is killed.
"""

import glob
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from unit.common import DistributedTest, get_master_port

if get_accelerator().device_name() != "cpu":
    pytest.skip("the shared-memory all-reduce is the CPU accelerator's", allow_module_level=True)

JOB = """
import os, sys, time
import torch
import deepspeed
import deepspeed.comm as dist

job_dir, then = sys.argv[-2:]  # after the launcher's --local_rank
deepspeed.init_distributed()
x = torch.full((1024, ), float(dist.get_rank() + 1))
dist.inference_all_reduce(x)
assert torch.all(x == sum(range(1, dist.get_world_size() + 1))), x
pid_file = os.path.join(job_dir, f"rank{dist.get_rank()}.pid")
with open(pid_file + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(pid_file + ".tmp", pid_file)
if then == "wait":
    time.sleep(600)
dist.barrier()
dist.destroy_process_group()  # left to exit, a rank can abort in teardown
"""


def shm_segments(port):
    return glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*")


def launch(tmpdir, port, then="exit"):
    """Start a 2-rank job with the deepspeed launcher; it all-reduces, writes its pids, then exits or waits."""
    job_dir = tmpdir.mkdir(f"job{port}")
    script = job_dir.join("job.py")
    script.write(JOB)
    cmd = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--num_accelerators", "2", "--master_port",
        str(port),
        str(script),
        str(job_dir), then
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, job_dir


class TestShmWorkspaceSegments(DistributedTest):
    world_size = 2

    def test_no_segment_outlives_initialization(self):
        x = torch.ones(8)
        dist.inference_all_reduce(x)
        assert torch.all(x == 2)
        assert shm_segments(os.environ["MASTER_PORT"]) == []


def test_concurrent_launcher_jobs_leave_no_segment(tmpdir):
    jobs = {port: launch(tmpdir, port) for port in (get_master_port(), get_master_port())}
    for port, (proc, _) in jobs.items():
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out
    for port in jobs:
        assert shm_segments(port) == []


def test_killed_rank_leaves_no_segment(tmpdir):
    port = get_master_port()
    proc, job_dir = launch(tmpdir, port, then="wait")
    pid_files = [job_dir.join(f"rank{rank}.pid") for rank in range(2)]
    deadline = time.monotonic() + 600
    while not all(f.check() for f in pid_files):
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.5)
    pids = [int(f.read()) for f in pid_files]
    os.kill(pids[1], signal.SIGKILL)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode != 0, out
    assert shm_segments(port) == []
