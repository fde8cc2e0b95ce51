# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A rank that loads a ZeRO checkpoint at the topology it was saved at looks only at its own rank files.

On a shared filesystem every look at a file is a metadata call to its server, and every rank looking
at every rank's optimizer file is N^2 of them at every restart of an N-rank job. A 2-rank job at
ZeRO-2 and ZeRO-3 saves a checkpoint and loads it, recording the paths that each rank stats or
opens during ``load_checkpoint``: no rank may touch a file of the other rank.
"""

import os
import sys

import pytest

import deepspeed.comm as dist

from unit.checkpoint.test_checkpoint_killed_save import initialize, train_step
from unit.common import DistributedTest

# The paths of the stats and opens of this process while a load is traced.
touched = None


def record_open(event, args):
    if touched is not None and event == "open" and isinstance(args[0], (str, os.PathLike)):
        touched.append(os.fspath(args[0]))


sys.addaudithook(record_open)


@pytest.mark.parametrize("stage", [2, 3])
class TestZeroLoadFileAccess(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test_each_rank_looks_at_its_own_files(self, stage, tmpdir):
        global touched
        save_dir = str(tmpdir)
        engine = initialize(stage)
        train_step(engine)
        engine.save_checkpoint(save_dir, tag="global_step1")
        engine.destroy()

        engine = initialize(stage)
        real_stat = os.stat

        def stat(path, *args, **kwargs):
            if isinstance(path, (str, os.PathLike)):
                touched.append(os.fspath(path))
            return real_stat(path, *args, **kwargs)

        touched, os.stat = [], stat
        try:
            load_path, _ = engine.load_checkpoint(save_dir)
        finally:
            seen, touched, os.stat = touched, None, real_stat
        assert load_path is not None

        names = {os.path.basename(path) for path in seen if os.path.dirname(path).endswith("global_step1")}
        own, other = f"zero_pp_rank_{dist.get_rank()}_", f"zero_pp_rank_{1 - dist.get_rank()}_"
        assert any(name.startswith(own) for name in names), names
        assert not [name for name in names if name.startswith(other)], names
        engine.destroy()
