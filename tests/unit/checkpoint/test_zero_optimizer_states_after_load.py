# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Right after a ZeRO-1/2 job loads the checkpoint it saved, on the same ranks, each parameter's
optimizer states read through ``safe_get_full_optimizer_state()``: the gathered states equal those
the run had when it saved, at ZeRO-2 and under the BF16 optimizer (ZeRO-1 in bf16), with the Hugging
Face Trainer's two parameter groups.

Before (deepspeed 0.19.8 too), ZeRO-1/2 linked each parameter to its optimizer states only at the
first step, so the call raised ``TypeError: argument of type 'NoneType' is not iterable`` until
then, although the states were loaded. A load on another number of ranks linked them already.
"""

import pytest
import torch

from unit.common import DistributedTest
from unit.checkpoint import zero_load_common
from unit.checkpoint.zero_load_common import TAG, assert_states_saved, initialize, save

# The fixtures: the folder the source checkpoints are saved in, once per session, and a test's source.
cache = zero_load_common.cache
saved = zero_load_common.saved

# Each source checkpoint: stage, tp, dp, dtype, optimizer. ZeRO-1 in bf16 runs the BF16 optimizer.
SOURCES = {
    "stage2-tp1dp2": (2, 1, 2, torch.float32, "adam"),
    "stage1-tp1dp2-bf16": (1, 1, 2, torch.bfloat16, "adam"),
}


class TestSave(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("source", list(SOURCES))
    def test_ws2(self, source, cache):
        save(cache, source, SOURCES[source])

    @pytest.mark.parametrize("source", list(SOURCES))
    def test_same_size(self, source, saved):
        stage, tp_size, _, dtype, optimizer = SOURCES[source]
        engine = initialize(stage, tp_size, dtype, optimizer)
        engine.load_checkpoint(saved, tag=TAG)
        assert_states_saved(engine, saved, optimizer, tp_size)
        engine.destroy()
