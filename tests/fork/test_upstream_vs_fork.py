# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The issue's ZeRO-3 reproducer, run on the fork's build and on the pinned upstream built with an empty series."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from forktools.upstream import removing_new_shm_segments
from unit.common import get_master_port

REPRODUCER = Path(__file__).with_name("zero3_reproducer.py")


def run_reproducer(site, world_size):
    port = get_master_port()
    # DeepSpeed JIT-builds its CPU shared-memory comm op on first use; a build directory per
    # site keeps the two builds from invalidating each other's op (the include paths differ).
    env = dict(os.environ,
               PYTHONPATH=str(site),
               LOCAL_SIZE=str(world_size),
               TORCH_EXTENSIONS_DIR=str(site.parent / "torch_extensions"))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={world_size}",
        "--master_addr=127.0.0.1", f"--master_port={port}",
        str(REPRODUCER)
    ]
    # The pinned release never removes its shared-memory all-reduce segments (66 MiB a rank).
    with removing_new_shm_segments():
        return subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)


@pytest.mark.parametrize("world_size", [1, 2])
def test_fork_trains(builds, world_size):
    proc = run_reproducer(builds["fork"], world_size)
    assert proc.returncode == 0, proc.stdout
    assert "OK deepspeed 0.19.8+fork." in proc.stdout


@pytest.mark.parametrize("world_size", [1, 2])
def test_pinned_upstream_fails_at_the_gather_assert(builds, world_size):
    proc = run_reproducer(builds["upstream"], world_size)
    assert proc.returncode != 0, proc.stdout
    assert "AssertionError" in proc.stdout and "'status': 'NOT_AVAILABLE'" in proc.stdout, proc.stdout
    assert "'numel': 0" in proc.stdout
