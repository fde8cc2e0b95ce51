# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Each rank verifies the CRC-32s of the checkpoint files it loads, not those of other ranks.

An AutoTP job (tensor-parallel size 2, ZeRO-2) saves a model states file per tensor-parallel rank;
loaded at the same tensor-parallel size, each rank reads its own. Each rank must verify the bytes of
its model states and optimizer files, and no others. Before, every rank read every tensor-parallel
rank's model states file to verify it: M times the model states it loads.
"""

import os

import deepspeed.comm as dist
from deepspeed.checkpoint import integrity

from unit.checkpoint.autotp_common import initialize, train_engine
from unit.common import DistributedTest


class TestVerifyOwnFiles(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test_autotp_rank_verifies_the_files_it_loads(self, tmpdir):
        save_dir = str(tmpdir)
        engine = initialize(2, tp_size=2)
        train_engine(engine, 2, 1)
        engine.save_checkpoint(save_dir, tag="step1")
        engine.destroy()

        verified, real_crc32_problems = [], integrity._crc32_problems

        def crc32_problems(path):
            verified.append(os.path.basename(path))
            return real_crc32_problems(path)

        fresh = initialize(2, tp_size=2)
        integrity._crc32_problems = crc32_problems
        try:
            fresh.load_checkpoint(save_dir, tag="step1")
        finally:
            integrity._crc32_problems = real_crc32_problems
        rank = dist.get_rank()
        loads = [f"mp_rank_0{rank}_model_states.pt", f"zero_pp_rank_0_mp_rank_0{rank}_optim_states.pt"]
        assert sorted(verified) == sorted(loads), verified
