# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The universal checkpoint format is the upstream release's, both ways: a checkpoint converted by
the fork's ds_to_universal restores with load_universal in the pinned upstream release, and one
converted by the release restores in the fork, at ZeRO-2 and ZeRO-3, bit for bit, optimizer
state included (the next steps' losses match). Checkpoints saved by the release resume in the
fork and convert with its ds_to_universal, whose readers load with weights_only=True. And a ZeRO-3
checkpoint of a model with zero-element parameters saved by the release loads in the fork, which
keeps those parameters unpartitioned."""

import os
import subprocess
import sys
from pathlib import Path

from forktools.upstream import removing_new_shm_segments
from unit.common import get_master_port

SCRIPT = Path(__file__).with_name("universal_cross_version.py")
ZERO_EMPTY_PARAMS_SCRIPT = Path(__file__).with_name("zero_empty_params_cross_version.py")


def run_side(site, *args, script=SCRIPT):
    """The script under the fork (``site`` None: the deepspeed this test session runs) or under the
    upstream release installed in ``site``."""
    port = get_master_port()
    env = dict(os.environ,
               MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port),
               RANK="0",
               LOCAL_RANK="0",
               WORLD_SIZE="1",
               LOCAL_SIZE="1")
    if site is not None:
        # As the reproducer test does: the upstream build's own JIT extension folder.
        env.update(PYTHONPATH=str(site), TORCH_EXTENSIONS_DIR=str(site.parent / "torch_extensions"))
    # The pinned release never removes its shared-memory all-reduce segments (66 MiB a rank).
    with removing_new_shm_segments():
        proc = subprocess.run([sys.executable, str(script), *map(str, args)],
                              env=env,
                              stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT,
                              text=True,
                              timeout=600)
    assert proc.returncode == 0 and f"OK {args[0]}" in proc.stdout, proc.stdout
    return proc.stdout


def test_universal_format_round_trips_with_upstream(builds, tmp_path):
    upstream = builds["upstream"]
    run_side(None, "save", tmp_path)
    run_side(None, "convert", tmp_path, "fork_universal")
    run_side(upstream, "convert", tmp_path, "upstream_universal")
    # The pinned release built with an empty series: no patch of the fork in it.
    assert "OK load deepspeed 0.19.8+fork.0." in run_side(upstream, "load", tmp_path, "fork_universal")
    run_side(None, "load", tmp_path, "upstream_universal")


def test_checkpoints_of_upstream_resume_and_convert_in_the_fork(builds, tmp_path):
    # Read with weights_only=True: what 0.19.8 pickles into its rank files is admitted.
    run_side(builds["upstream"], "save", tmp_path)
    # Every record of 0.19.8's files has its CRC-32, which the fork verifies before it reads them.
    for stage_folder in sorted(tmp_path.glob("stage*")):
        proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.verify_checkpoint",
                               str(stage_folder)],
                              stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT,
                              text=True)
        assert proc.returncode == 0 and "step2: OK" in proc.stdout, proc.stdout
    run_side(None, "resume", tmp_path)
    run_side(None, "convert", tmp_path, "fork_universal")
    run_side(None, "load", tmp_path, "fork_universal")


def test_zero_element_params_checkpoint_of_upstream_loads(builds, tmp_path):
    # 0.19.8 saves zero-element parameters as (0,) placeholders; the fork keeps them whole.
    run_side(builds["upstream"], "save", tmp_path, script=ZERO_EMPTY_PARAMS_SCRIPT)
    run_side(None, "load", tmp_path, script=ZERO_EMPTY_PARAMS_SCRIPT)
