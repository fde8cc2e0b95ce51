# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``engine.load_checkpoint()`` of a ZeRO checkpoint saved at another ZeRO stage (ZeRO-2 -> 3 to fit
a longer context, 3 -> 2 for speed, 1 -> 3), at the same or another data-parallel size, loads it as
it is, with its optimizer states: no ``ds_to_universal``, no config change. Right after the load the
weights are those ``zero_to_fp32`` reads from the checkpoint, the fp32 master weights, the
optimizer's states (Adam's moments, SGD's momentum, Adagrad's sums) and step counts are the saved
ones, the LR scheduler and client state are restored, each of the optimizer's two parameter groups
(the Hugging Face Trainer's) keeps its own hyperparameters, and the next steps' losses are those of
the run that saved the checkpoint and went on training uninterrupted. Covered: 1 -> 3, 2 -> 3,
3 -> 2 and 3 -> 1 at data-parallel sizes 2 -> 2, 2 -> 1 and 1 -> 2, in fp32 and bf16, with torch's
Adam, SGD and Adagrad, with a model whose output embeddings are its input embeddings and one with a
zero-element parameter. The offline path moves too: the checkpoint converted by ``ds_to_universal``
loads at the other stage with ``load_universal``, its step counts included (a universal checkpoint
of ZeRO-3 saves them with its global state only). A load of the weights alone
(``load_optimizer_states=False``) at another stage gives the checkpoint's weights. What cannot be
moved (a ZeRO-3 checkpoint whose frozen parameters are partitioned across the saving ranks, into
ZeRO-2) is refused before anything is loaded, naming both stages and data-parallel sizes.

On deepspeed 0.19.8 each of these loads fails with a bare ``AssertionError`` from the state dict
loader, which finds no model states file named as its own stage names them.
"""

import os

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from unit.common import DistributedTest
from unit.checkpoint import zero_load_common
from unit.checkpoint.autotp_common import convert_to_universal_checkpoint, train_engine
from unit.checkpoint.zero_load_common import (TAG, UNIVERSAL_TAG, assert_refused, full_weights, initialize,
                                              load_and_train, save)

# The fixtures: the folder the source checkpoints are saved in, once per session, and a test's source.
cache = zero_load_common.cache
saved = zero_load_common.saved

# Each source checkpoint: stage, tp, dp, dtype, optimizer and, for tied input and output embeddings,
# "tied". At bf16 with fp32 gradient accumulation ZeRO-1 runs the BF16 optimizer.
SOURCES = {
    "stage1-tp1dp2": (1, 1, 2, torch.float32, "adam"),
    "stage2-tp1dp1": (2, 1, 1, torch.float32, "adam"),
    "stage3-tp1dp1": (3, 1, 1, torch.float32, "adam"),
    "stage2-tp1dp2-tied": (2, 1, 2, torch.float32, "adam", "tied"),
    "stage3-tp1dp2-tied": (3, 1, 2, torch.float32, "adam", "tied"),
    "stage1-tp1dp2-bf16": (1, 1, 2, torch.bfloat16, "adam"),
    "stage3-tp1dp2-bf16": (3, 1, 2, torch.bfloat16, "adam"),
    "stage2-tp1dp2-sgd": (2, 1, 2, torch.float32, "sgd"),
    "stage3-tp1dp2-adagrad-tied-bf16": (3, 1, 2, torch.bfloat16, "adagrad", "tied"),
}


class TestSave(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.world_size(1)
    @pytest.mark.parametrize("source", [name for name, spec in SOURCES.items() if spec[1] * spec[2] == 1])
    def test_ws1(self, source, cache):
        save(cache, source, SOURCES[source])

    @pytest.mark.parametrize("source", [name for name, spec in SOURCES.items() if spec[1] * spec[2] == 2])
    def test_ws2(self, source, cache):
        save(cache, source, SOURCES[source])


class TestLoad(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("source,stage", [("stage1-tp1dp2", 3),
                                              ("stage2-tp1dp2-tied", 3), ("stage3-tp1dp2-tied", 2),
                                              ("stage3-tp1dp2-tied", 1), ("stage2-tp1dp1", 3), ("stage3-tp1dp1", 2),
                                              ("stage1-tp1dp2-bf16", 3), ("stage3-tp1dp2-bf16", 1),
                                              ("stage2-tp1dp2-sgd", 3), ("stage3-tp1dp2-adagrad-tied-bf16", 1),
                                              ("stage3-tp1dp2-adagrad-tied-bf16", 2)])
    def test_ws2(self, source, stage, saved):
        load_and_train(saved, SOURCES[source], dp_size=2, stage=stage)

    @pytest.mark.world_size(1)
    @pytest.mark.parametrize("source,stage", [("stage2-tp1dp2-tied", 3), ("stage3-tp1dp2-tied", 1)])
    def test_ws1(self, source, stage, saved):
        load_and_train(saved, SOURCES[source], dp_size=1, stage=stage)

    @pytest.mark.parametrize("source,stage", [("stage2-tp1dp2-tied", 3), ("stage3-tp1dp2-tied", 2)])
    def test_universal(self, source, stage, saved, tmpdir):
        # The offline path: the checkpoint converted by ds_to_universal, loaded at the other stage.
        if dist.get_rank() == 0:
            convert_to_universal_checkpoint(os.path.join(saved, TAG), os.path.join(str(tmpdir), UNIVERSAL_TAG))
        dist.barrier()
        load_and_train(saved, SOURCES[source], dp_size=2, universal_dir=str(tmpdir), stage=stage)

    @pytest.mark.parametrize("source,stage", [("stage2-tp1dp2-tied", 3), ("stage3-tp1dp2-tied", 2)])
    def test_weights_only(self, source, stage, saved):
        engine = initialize(stage, tp_size=1, tied=True)
        load_path, _ = engine.load_checkpoint(saved, tag=TAG, load_optimizer_states=False)
        assert load_path is not None
        weights = full_weights(engine, stage, tp_size=1)
        if dist.get_rank() == 0:
            expected = get_fp32_state_dict_from_zero_checkpoint(saved, tag=TAG)
            assert sorted(weights) == sorted(expected)
            for name, value in expected.items():
                assert torch.equal(weights[name], value), name
        dist.barrier()
        engine.destroy()


class TestRefuse(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test_partitioned_frozen_params(self, tmpdir):
        # ZeRO-3 partitions frozen parameters across the saving ranks too, in the model states files.
        folder = str(tmpdir)
        engine = initialize(3, tp_size=1, frozen=True)
        train_engine(engine, 1, 1)
        engine.save_checkpoint(folder, tag=TAG)
        engine.destroy()

        engine = initialize(2, tp_size=1, frozen=True)
        match = ("saved at ZeRO stage 3 and data-parallel size 2, at ZeRO stage 2 and data-parallel size 2: its "
                 r"frozen parameters are partitioned across the saving ranks\. Nothing was loaded; load it at ZeRO "
                 "stage 3 and data-parallel size 2")
        assert_refused(engine, folder, match)
        engine.destroy()

        # The checkpoint is complete: it loads at the stage that saved it.
        engine = initialize(3, tp_size=1, frozen=True)
        load_path, _ = engine.load_checkpoint(folder, tag=TAG)
        assert load_path is not None and engine.global_steps == 1
        engine.destroy()
