# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A checkpoint that does not load says why, and calls nothing corrupt that is not.

- A checkpoint loaded on another data-parallel size into a model whose parameters are not those
  saved (the vocabulary and MLP widened from 128 to 129) is refused before anything is loaded,
  naming each parameter and both shapes, rather than failing half way with a bare ``KeyError`` or
  a size mismatch.
- A checkpoint file that reads fine but cannot be mapped to the device asked for raises torch's own
  error, not "incomplete or corrupt ... save the checkpoint again"; a truncated file is still
  reported as corrupt.
"""

import os

import pytest
import torch

from deepspeed.checkpoint.utils import load_checkpoint_file

from unit.common import DistributedTest
from unit.checkpoint import zero_load_common
from unit.checkpoint.zero_load_common import assert_refused, initialize, save

# The fixtures: the folder the source checkpoints are saved in, once per session, and a test's source.
cache = zero_load_common.cache
saved = zero_load_common.saved

# Each source checkpoint: stage, tp, dp, dtype, optimizer.
SOURCES = {f"stage{stage}-tp1dp2": (stage, 1, 2, torch.float32, "adam") for stage in (2, 3)}


class TestSave(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("source", list(SOURCES))
    def test_ws2(self, source, cache):
        save(cache, source, SOURCES[source])


class TestOtherParameters(DistributedTest):
    world_size = 1
    reuse_dist_env = True

    @pytest.mark.parametrize("source", list(SOURCES))
    def test_resized_parameters(self, source, saved):
        engine = initialize(SOURCES[source][0], tp_size=1, uneven=True)
        match = (r"into this model, whose parameters are not those saved: model\.embed_tokens\.weight \(saved "
                 r"\(128, 64\), now \(129, 64\)\), .*lm_head\.weight \(saved \(128, 64\), now \(129, 64\)\)\. "
                 "Nothing was loaded")
        assert_refused(engine, saved, match)


class TestCorruptOnlyWhenCorrupt(DistributedTest):
    world_size = 1

    def test_load_checkpoint_file_errors(self, tmpdir):
        path = os.path.join(str(tmpdir), "states.pt")
        torch.save({"weight": torch.ones(4)}, path)
        # A device this machine does not have: torch's error, as it is.
        with pytest.raises(RuntimeError, match="deserialize object on") as error:
            load_checkpoint_file(path, map_location=torch.device("cuda", 99))
        assert "incomplete or corrupt" not in str(error.value)

        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        with pytest.raises(ValueError, match="is incomplete or corrupt"):
            load_checkpoint_file(path)
