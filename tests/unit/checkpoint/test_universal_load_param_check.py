# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A universal checkpoint loaded into a model whose parameters are not those saved (the vocabulary
and MLP widened from 128 to 129) is refused before anything is loaded, naming each parameter and
both shapes, as a load from the rank files is. ZeRO-3 loaded it without a word, each rank's
partition cut out of the wrong whole; ZeRO-1 failed half way, after some parameters were loaded,
with a bare ``AssertionError``.
"""

import os

import pytest
import torch

from unit.common import DistributedTest
from unit.checkpoint import zero_load_common
from unit.checkpoint.autotp_common import convert_to_universal_checkpoint
from unit.checkpoint.zero_load_common import TAG, UNIVERSAL_TAG, assert_refused, initialize, save

# The fixtures: the folder the source checkpoints are saved in, once per session, and a test's source.
cache = zero_load_common.cache
saved = zero_load_common.saved

# Each source checkpoint: stage, tp, dp, dtype, optimizer.
SOURCES = {"stage3-tp1dp2": (3, 1, 2, torch.float32, "adam")}


class TestSave(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("source", list(SOURCES))
    def test_ws2(self, source, cache):
        save(cache, source, SOURCES[source])


class TestOtherParameters(DistributedTest):
    world_size = 1
    reuse_dist_env = True

    @pytest.mark.parametrize("stage", [1, 3])
    @pytest.mark.parametrize("source", list(SOURCES))
    def test_resized_parameters(self, source, stage, saved, tmpdir):
        convert_to_universal_checkpoint(os.path.join(saved, TAG), os.path.join(str(tmpdir), UNIVERSAL_TAG))
        engine = initialize(stage, tp_size=1, uneven=True, load_universal=True)
        match = (r"Cannot load the universal checkpoint .* into this model, whose parameters are not those saved: "
                 r"model\.embed_tokens\.weight \(saved \(128, 64\), now \(129, 64\)\), .*lm_head\.weight \(saved "
                 r"\(128, 64\), now \(129, 64\)\)\. Nothing was loaded")
        assert_refused(engine, str(tmpdir), match, tag=UNIVERSAL_TAG)
