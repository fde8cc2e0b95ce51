# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``engine.load_checkpoint()`` of a ZeRO checkpoint saved at another AutoTP size (``tensor_parallel.
autotp_size``) loads it as it is, with its optimizer states, at ZeRO stages 1, 2 and 3:
tp2dp1 -> tp1dp2 and tp1dp2 -> tp2dp1, fp32 and bf16, on a model whose vocabulary and MLP width (129)
split unevenly over 2 ranks and that holds a zero-element parameter. Each rank copies its new shard of
every state from the saved shards, as the tensor-parallel layouts that AutoTP records with the
checkpoint plan it. Right after the load the weights are those ``zero_to_fp32`` reads from the
checkpoint, the fp32 weights and the optimizer's states (Adam's moments; SGD's momentum and Adagrad's
sums, as client optimizers), merged over the tensor-parallel ranks, are the saved ones, each parameter
group keeps its hyperparameters, and the next steps' losses are those of the run that saved the
checkpoint and went on training uninterrupted; so do loads that change the ZeRO stage too (tp2dp1
ZeRO-2 -> tp1dp2 ZeRO-3, tp1dp2 ZeRO-3 -> tp2dp1 ZeRO-1, tp2dp1 ZeRO-1 bf16 with Adagrad -> tp1dp2
ZeRO-3). A checkpoint whose model states record no tensor-parallel layouts is refused before anything
is loaded, naming ``ds_to_universal``.

Without the change each of these loads is refused before anything is loaded, naming
``ds_to_universal``.
"""

import glob
import os
import shutil

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.checkpoint.constants import AFFINE_MAP, UNIVERSAL_CHECKPOINT_INFO

from unit.checkpoint.autotp_common import forget_saved_files
from unit.common import DistributedTest
from unit.checkpoint import zero_load_common
from unit.checkpoint.zero_load_common import TAG, assert_refused, initialize, load_and_train, save

cache = zero_load_common.cache
saved = zero_load_common.saved

# Each source checkpoint: stage, tp, dp, dtype, optimizer, model.
SOURCES = {
    f"stage{stage}-{layout}": (stage, tp, 2 // tp, torch.float32, "adam", "uneven")
    for stage in (1, 2, 3)
    for layout, tp in (("tp1dp2", 1), ("tp2dp1", 2))
}
# At bf16 with fp32 gradient accumulation ZeRO-1 runs the BF16 optimizer.
SOURCES["stage1-tp2dp1-bf16"] = (1, 2, 1, torch.bfloat16, "adam", "uneven")
SOURCES["stage3-tp1dp2-bf16"] = (3, 1, 2, torch.bfloat16, "adam", "uneven")
SOURCES["stage2-tp2dp1-sgd"] = (2, 2, 1, torch.float32, "sgd", "uneven")
SOURCES["stage1-tp2dp1-adagrad-bf16"] = (1, 2, 1, torch.bfloat16, "adagrad", "uneven")


class TestSave(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("source", list(SOURCES))
    def test_ws2(self, source, cache):
        save(cache, source, SOURCES[source])


class TestLoad(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("source", list(SOURCES))
    def test_ws2(self, source, saved):
        tp_size = 3 - SOURCES[source][1]
        load_and_train(saved, SOURCES[source], dp_size=2 // tp_size, tp_size=tp_size)

    @pytest.mark.parametrize("source, stage", [("stage2-tp2dp1", 3), ("stage3-tp1dp2", 1),
                                               ("stage1-tp2dp1-adagrad-bf16", 3)])
    def test_other_stage(self, source, stage, saved):
        # A tensor-parallel size and a ZeRO stage changed at once.
        tp_size = 3 - SOURCES[source][1]
        load_and_train(saved, SOURCES[source], dp_size=2 // tp_size, tp_size=tp_size, stage=stage)


class TestRefuse(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("source", ["stage2-tp2dp1"])
    def test_no_tensor_parallel_layout(self, source, saved, tmpdir):
        folder = str(tmpdir)
        if dist.get_rank() == 0:
            shutil.copytree(os.path.join(saved, TAG), os.path.join(folder, TAG))
            for path in glob.glob(os.path.join(folder, TAG, "mp_rank_*_model_states.pt")):
                state = torch.load(path, weights_only=False)
                del state[UNIVERSAL_CHECKPOINT_INFO][AFFINE_MAP]
                torch.save(state, path)
            forget_saved_files(os.path.join(folder, TAG))
        dist.barrier()
        engine = initialize(2, tp_size=1, uneven=True)
        match = (r"saved at tensor-parallel size 2 and data-parallel size 1, at tensor-parallel size 1 and "
                 r"data-parallel size 2: tensor-parallel layouts that do not compose: .*model\.embed_tokens\.weight "
                 r"\(no recorded tensor-parallel layout\).* Nothing was loaded; convert it with ds_to_universal")
        assert_refused(engine, folder, match)
