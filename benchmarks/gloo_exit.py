# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""How often a finished 2-rank gloo job aborts at exit, with and without a destroy of its process group.

A job that leaves its gloo process group to the interpreter's exit now and then aborts after it
finished ("terminate called without an active exception", SIGABRT): gloo's worker threads can
still hold the last collective's work when Python is finalized (pytorch#190489).
``deepspeed.init_distributed`` now destroys the gloo process group it created at exit.

Each run starts 2 processes (``RANK``/``WORLD_SIZE`` in the environment, as a launcher sets them)
that initialize, all-reduce 20 times, meet at a barrier and exit; a run fails when either exits
non-zero. With ``--job gather`` they do what a ZeRO-3 engine does instead: a Python object holds
the process group (as the engine and ``deepspeed.utils.groups`` do), each step all-gathers into a
view of a parameter's buffer and drops it, the last gather is still in flight at the barrier, and
the script ends. There the destroy is not enough: a gloo worker frees the gathered tensors after the
barrier has completed, and needs the GIL for it; once Python finalizes, taking it aborts the process.
With ``--job zero3`` they run a ZeRO-3 engine (``deepspeed.initialize`` with a ZeRO-3 config, torch's
Adam, a few steps) and exit the way a script with the HF Trainer does: the script still holds the engine
(and, through it, the optimizer, the parameters and their process groups) when Python exits, so only
the exit handler's drop of DeepSpeed's references frees the groups and joins their worker threads.
The variants, interleaved run by run:

- ``deepspeed``: ``deepspeed.init_distributed(dist_backend="gloo")``, the installed fork as it is;
- ``deepspeed-no-exit-destroy``: the same, with the fork's exit handler unregistered after
  ``init_distributed`` (0.19.8's behaviour);
- ``deepspeed-destroy-only``: the same, with the handler replaced by a bare destroy of the process
  group (the handler without its drop of DeepSpeed's references to the groups);
- ``deepspeed-destroy-wait``: the same, with the handler replaced by the fork's earlier one: the destroy,
  then a wait of 0.1 s with the GIL released (for the worker threads of the groups still held);
- ``torch``: ``torch.distributed.init_process_group("gloo")``, no destroy;
- ``torch-destroy``: the same, with ``destroy_process_group()`` registered with ``atexit``;
- ``torch-destroy-wait``: the same, followed by the fork handler's wait (0.1 s with the GIL
  released).

Usage, from the repository root, with the fork installed (``--load N`` runs N busy processes beside
the jobs, as a loaded CI machine does; ``--fork`` forks each run's ranks from a process that imported
torch and DeepSpeed once, instead of starting them, which saves the imports' seconds in every run):

    python benchmarks/gloo_exit.py [--runs 40] [--job all_reduce|gather|zero3] [--load 2] [--fork] \
        [--variants deepspeed,deepspeed-no-exit-destroy]
"""

import argparse
import os
import subprocess
import sys

from checkpoint_tools import free_port

JOB = """
import atexit, sys
import torch

variant, job = sys.argv[1:3]
if variant.startswith("deepspeed"):
    import deepspeed
    import deepspeed.comm as dist
    deepspeed.init_distributed(dist_backend="gloo")
    if variant != "deepspeed":
        from deepspeed.comm.torch import _destroy_process_group_at_exit
        atexit.unregister(_destroy_process_group_at_exit)
    if variant == "deepspeed-destroy-only":
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    if variant == "deepspeed-destroy-wait":
        import time
        # atexit runs the last registered first: the destroy, then this wait.
        atexit.register(time.sleep, 0.1)
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
else:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    if variant == "torch-destroy-wait":
        # atexit runs the last registered first: the destroy, then this wait.
        import time
        atexit.register(time.sleep, 0.1)
    if variant.startswith("torch-destroy"):
        atexit.register(dist.destroy_process_group)
if job == "zero3":
    import deepspeed
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 3},
        "zero_force_ds_cpu_optimizer": False,
    }
    # Held by the script to the end, as the HF Trainer holds its engine.
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for _ in range(4):
        engine.backward(engine(torch.randn(2, 64)).sum())
        engine.step()
elif job == "all_reduce":
    x = torch.ones(1 << 16)
    for _ in range(20):
        dist.all_reduce(x)
else:
    held = [torch.distributed.group.WORLD]
    for step in range(50):
        flat = torch.nn.Parameter(torch.zeros(2 << 10), requires_grad=False)
        work = dist.all_gather_into_tensor(flat.view(-1), torch.ones(1 << 10), async_op=True)
        if step < 49:
            work.wait()
        del flat, work
dist.barrier()
"""

# With --fork: one process imports torch and DeepSpeed once (the imports take most of a run's time on a
# small machine) and forks the 2 ranks of every run from there, before any thread has started. A rank
# runs the job at the top level of the script and exits as a script does: atexit handlers, then the
# interpreter's teardown.
FORK_SERVER = """
import os, signal, sys
import torch, torch._dynamo, deepspeed

JOB = sys.argv[1]
for line in sys.stdin:
    variant, job, port = line.split()
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            break
        pids.append(pid)
    else:
        print("statuses", *[os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids], flush=True)
        continue
    break
else:
    sys.exit()
devnull = os.open(os.devnull, os.O_WRONLY)
os.dup2(devnull, 1)
os.dup2(devnull, 2)
signal.alarm(300)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank))
sys.argv[1:] = [variant, job]
exec(JOB)
"""

VARIANTS = [
    "deepspeed", "deepspeed-no-exit-destroy", "deepspeed-destroy-only", "deepspeed-destroy-wait", "torch",
    "torch-destroy", "torch-destroy-wait"
]


def run(variant, job, server=None):
    """Run the job once on 2 ranks (forked by the server, if given); return the exit statuses."""
    port = free_port()
    if server is not None:
        server.stdin.write(f"{variant} {job} {port}\n")
        server.stdin.flush()
        # DeepSpeed logs to stdout too.
        line = server.stdout.readline()
        while not line.startswith("statuses "):
            if not line:
                raise RuntimeError("the fork server exited")
            line = server.stdout.readline()
        return [int(status) for status in line.split()[1:]]
    procs = []
    for rank in range(2):
        env = dict(os.environ,
                   MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port),
                   WORLD_SIZE="2",
                   RANK=str(rank),
                   LOCAL_RANK=str(rank),
                   OMP_NUM_THREADS="1")
        procs.append(
            subprocess.Popen([sys.executable, "-c", JOB, variant, job],
                             env=env,
                             stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL))
    return [proc.wait(timeout=300) for proc in procs]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--job", choices=["all_reduce", "gather", "zero3"], default="all_reduce")
    parser.add_argument("--load", type=int, default=0, help="busy processes to run beside the jobs")
    parser.add_argument("--fork", action="store_true", help="fork the ranks from a process that imported DeepSpeed")
    args = parser.parse_args()
    variants = args.variants.split(",")
    failed = {variant: [] for variant in variants}
    server = None
    if args.fork:
        server = subprocess.Popen([sys.executable, "-c", FORK_SERVER, JOB],
                                  env=dict(os.environ, OMP_NUM_THREADS="1"),
                                  stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE,
                                  text=True)
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        for _ in range(args.runs):
            for variant in variants:
                statuses = run(variant, args.job, server)
                if any(statuses):
                    failed[variant].append(statuses)
    finally:
        for proc in load:
            proc.kill()
        if server is not None:
            server.stdin.close()
            server.wait()
    print("| variant | runs | failed | exit statuses of the failed runs |")
    print("|---|---|---|---|")
    for variant in variants:
        print(f"| {variant} | {args.runs} | {len(failed[variant])} | {failed[variant]} |")


if __name__ == "__main__":
    main()
