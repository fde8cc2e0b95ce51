# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``engine.load_checkpoint()`` of a ZeRO-1, -2 or -3 checkpoint saved at another data-parallel size
loads it as it is, with its optimizer states: no ``ds_to_universal``, no config change. Right after
the load the weights are those ``zero_to_fp32`` reads from the checkpoint, the fp32 master weights,
Adam's moments and step counts are the saved ones, the LR scheduler and client state are restored,
each of the optimizer's two parameter groups (the Hugging Face Trainer's: weight decay on matrices,
none on norm weights) keeps its own hyperparameters, and the next steps' losses are those of the
run that saved the checkpoint and went on training uninterrupted on the same global batches (a
resume, not a restart). Covered: data-parallel sizes 2 -> 1 and 1 -> 2 at every stage, 2 -> 1 with
the BF16 optimizer (bf16 ZeRO-1), and AutoTP checkpoints (tp2, dp1 -> dp2) at ZeRO-2 and -3, each
model with a zero-element parameter.

What cannot be resharded is refused before anything is loaded: a checkpoint whose optimizer files
lack the fragment metadata.

The saving and the loading run at different world sizes, so each source checkpoint is saved by a
test of its own (``TestSave``) into a cache shared by the session (``zero_load_common``).

On deepspeed 0.19.8 every such load raises "Automatic adjustment of ZeRO's optimizer state
partitioning with a new world size is not currently supported".
"""

import glob
import os
import shutil

import pytest
import torch

from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, PARAM_SLICE_MAPPINGS

from unit.checkpoint.autotp_common import forget_saved_files
from unit.common import DistributedTest
from unit.checkpoint import zero_load_common
from unit.checkpoint.zero_load_common import (TAG, assert_refused, initialize, load_and_train, save)

# The fixtures: the folder the source checkpoints are saved in, once per session, and a test's source.
cache = zero_load_common.cache
saved = zero_load_common.saved

# Each source checkpoint: stage, tp, dp, dtype, optimizer. At bf16 with fp32 gradient accumulation
# ZeRO-1 runs the BF16 optimizer.
SOURCES = {f"stage{stage}-tp1dp{dp}": (stage, 1, dp, torch.float32, "adam") for stage in (1, 2, 3) for dp in (1, 2)}
SOURCES.update({f"stage{stage}-tp2dp1": (stage, 2, 1, torch.float32, "adam") for stage in (2, 3)})
SOURCES["stage1-tp1dp2-bf16"] = (1, 1, 2, torch.bfloat16, "adam")


class TestSave(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.world_size(1)
    @pytest.mark.parametrize("source", [name for name, (_, tp, dp, _, _) in SOURCES.items() if tp * dp == 1])
    def test_ws1(self, source, cache):
        save(cache, source, SOURCES[source])

    @pytest.mark.parametrize("source", [name for name, (_, tp, dp, _, _) in SOURCES.items() if tp * dp == 2])
    def test_ws2(self, source, cache):
        save(cache, source, SOURCES[source])


class TestLoad(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.world_size(1)
    @pytest.mark.parametrize("source", ["stage1-tp1dp2", "stage2-tp1dp2", "stage3-tp1dp2", "stage1-tp1dp2-bf16"])
    def test_ws1(self, source, saved):
        load_and_train(saved, SOURCES[source], dp_size=1)

    @pytest.mark.parametrize("source", ["stage1-tp1dp1", "stage2-tp1dp1", "stage3-tp1dp1"])
    def test_ws2(self, source, saved):
        load_and_train(saved, SOURCES[source], dp_size=2)

    @pytest.mark.world_size(4)
    @pytest.mark.parametrize("source", ["stage2-tp2dp1", "stage3-tp2dp1"])
    def test_ws4(self, source, saved):
        load_and_train(saved, SOURCES[source], dp_size=2)


class TestRefuse(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.world_size(1)
    @pytest.mark.parametrize("source", ["stage1-tp1dp2"])
    def test_no_fragment_metadata(self, source, saved, tmpdir):
        # A checkpoint whose optimizer files do not say where each parameter lies in them.
        folder = str(tmpdir)
        shutil.copytree(os.path.join(saved, TAG), os.path.join(folder, TAG))
        for path in glob.glob(os.path.join(folder, TAG, "*_optim_states.pt")):
            state = torch.load(path, weights_only=False)
            del state[OPTIMIZER_STATE_DICT][PARAM_SLICE_MAPPINGS]
            torch.save(state, path)
        forget_saved_files(os.path.join(folder, TAG))
        engine = initialize(1, tp_size=1)
        match = f"lacks the metadata to reshard .*records no {PARAM_SLICE_MAPPINGS}.*"
        assert_refused(engine, folder, match + "load it at data-parallel size 2")
