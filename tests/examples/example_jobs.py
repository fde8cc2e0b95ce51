# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Run an example script of examples/ as its users do, on a number of ranks."""

import subprocess
import sys
from pathlib import Path

from unit.common import get_master_port

REPO = Path(__file__).resolve().parents[2]


def torchrun(script, num_ranks, *args):
    """Run ``script`` under ``torch.distributed.run`` on ``num_ranks`` ranks; it must exit 0. Returns its
    output."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
        str(num_ranks), "--master_port",
        str(get_master_port()),
        str(script), *map(str, args)
    ]
    proc = subprocess.run(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout
    return proc.stdout
