# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A gloo job that leaves its process group to the interpreter's exit ends with status 0.

Left to the interpreter's teardown, gloo's worker threads can still hold the last collective's work
when Python is gone, and now and then a process aborts after its job finished ("terminate called without
an active exception", exit status 134). ``init_distributed`` destroys the process group it created
at exit, before the teardown, and leaves a process group that the script created alone.

A destroy alone does not stop the worker threads of the groups that Python objects still hold: a ZeRO-3
engine, its optimizer and its parameters hold groups and the script holds the engine until the teardown.
The exit handler drops DeepSpeed's references to them, so that every gloo worker thread is joined before
the teardown, also where the script created the process group and destroys it itself (accelerate's
``PartialState`` creates it for the HF Trainer on CPU).
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

# A ZeRO-3 job that ends holding its engine, as scripts and the HF Trainer do. Linux names each thread
# in /proc/self/task: torch's gloo worker threads are "pt_gloo_runloop", gloo's transport's "gloo_tcp_loop".
ZERO3_JOB = """
import atexit, os, sys
import torch
import deepspeed
import deepspeed.comm as dist

def gloo_threads():
    names = [open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task")]
    return sum("gloo" in name for name in names)

def at_exit():
    print(f"rank {rank}: gloo threads at teardown: {gloo_threads()}")


atexit.register(at_exit)
if sys.argv[-1] == "script":
    # As accelerate does for the HF Trainer on CPU, after transformers imported torch.distributed.nn (its
    # functions keep the default group of the moment it is imported as their default argument).
    import torch.distributed.nn
    torch.distributed.init_process_group("gloo")
deepspeed.init_distributed(dist_backend="gloo")
rank = dist.get_rank()
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
config = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
    "zero_optimization": {"stage": 3},
    "zero_force_ds_cpu_optimizer": False,
}
engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
for _ in range(2):
    engine.backward(engine(torch.randn(2, 16)).sum())
    engine.step()
print(f"rank {rank}: gloo threads at the end of the script: {gloo_threads()}")
if sys.argv[-1] == "script":
    torch.distributed.destroy_process_group()
"""


def run_job(tmpdir, created_by, job=JOB):
    script = tmpdir.join("job.py")
    script.write(job)
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


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts the threads in /proc/self/task")
@pytest.mark.parametrize("created_by", ["deepspeed", "script"])
def test_zero3_engine_gloo_threads_joined_at_exit(tmpdir, created_by):
    proc = run_job(tmpdir, created_by, job=ZERO3_JOB)
    assert proc.returncode == 0, proc.stdout
    for rank in range(2):
        assert f"rank {rank}: gloo threads at the end of the script: 0" not in proc.stdout, proc.stdout
        assert f"rank {rank}: gloo threads at teardown: 0" in proc.stdout, proc.stdout
