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
non-zero. The variants, interleaved run by run:

- ``deepspeed``: ``deepspeed.init_distributed(dist_backend="gloo")``, the installed fork as it is;
- ``deepspeed-no-exit-destroy``: the same, with the fork's exit handler unregistered after
  ``init_distributed`` (0.19.8's behaviour);
- ``torch``: ``torch.distributed.init_process_group("gloo")``, no destroy;
- ``torch-destroy``: the same, with ``destroy_process_group()`` registered with ``atexit``.

Usage, from the repository root, with the fork installed:

    python benchmarks/gloo_exit.py [--runs 40] [--variants deepspeed,deepspeed-no-exit-destroy]
"""

import argparse
import os
import subprocess
import sys

from checkpoint_tools import free_port

JOB = """
import atexit, sys
import torch

variant = sys.argv[1]
if variant.startswith("deepspeed"):
    import deepspeed
    import deepspeed.comm as dist
    deepspeed.init_distributed(dist_backend="gloo")
    if variant == "deepspeed-no-exit-destroy":
        from deepspeed.comm.torch import _destroy_process_group_at_exit
        atexit.unregister(_destroy_process_group_at_exit)
else:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    if variant == "torch-destroy":
        atexit.register(dist.destroy_process_group)
x = torch.ones(1 << 16)
for _ in range(20):
    dist.all_reduce(x)
dist.barrier()
"""

VARIANTS = ["deepspeed", "deepspeed-no-exit-destroy", "torch", "torch-destroy"]


def run(variant):
    """Run the job once on 2 ranks; return the exit statuses."""
    port = free_port()
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
            subprocess.Popen([sys.executable, "-c", JOB, variant],
                             env=env,
                             stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL))
    return [proc.wait(timeout=300) for proc in procs]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    variants = args.variants.split(",")
    failed = {variant: [] for variant in variants}
    for _ in range(args.runs):
        for variant in variants:
            statuses = run(variant)
            if any(statuses):
                failed[variant].append(statuses)
    print("| variant | runs | failed | exit statuses of the failed runs |")
    print("|---|---|---|---|")
    for variant in variants:
        print(f"| {variant} | {args.runs} | {len(failed[variant])} | {failed[variant]} |")


if __name__ == "__main__":
    main()
