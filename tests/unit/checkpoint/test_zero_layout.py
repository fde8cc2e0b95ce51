# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``deepspeed.checkpoint.zero_layout`` says where each element of every parameter's saved states lies
in the optimizer files of a ZeRO checkpoint: ``param_slice_mappings`` at ZeRO-1/2, ``param_shapes``
and the partitioning rule at ZeRO-3. ``ds_to_universal`` and the load of a checkpoint saved at
another data-parallel size read the rank files through it.

A 2-rank job trains a small Llama with the Hugging Face Trainer's two parameter groups and a
zero-element placeholder, and saves it. Read through the layout from the memory-mapped rank files,
every parameter's fp32 weights and Adam moments must come out whole, each element from exactly one
fragment, equal to what the engine gathers from its ranks.
"""

import os

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, PARAM_SHAPES
from deepspeed.checkpoint.utils import find_rank_files, load_checkpoint_file
from deepspeed.checkpoint.zero_layout import FragmentReader, index_fragments, zero3_rank_fragments, zero_rank_fragments

from unit.checkpoint.autotp_common import train_engine
from unit.checkpoint.zero_load_common import initialize, optimizer_states
from unit.common import DistributedTest


@pytest.mark.parametrize("stage", [1, 2, 3])
class TestZeroLayout(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test_every_element_in_one_fragment(self, stage, tmpdir):
        engine = initialize(stage, tp_size=1)
        train_engine(engine, tp_size=1, steps=2)
        engine.save_checkpoint(str(tmpdir), tag="step2")
        expected, _ = optimizer_states(engine, "adam")
        engine.destroy()
        if dist.get_rank() != 0:
            return

        rank_files = find_rank_files(os.path.join(str(tmpdir), "step2"))
        index = {}
        for dp_index in range(dist.get_world_size()):
            optim_sd = load_checkpoint_file(rank_files[("optim", dp_index, 0)][0])[OPTIMIZER_STATE_DICT]
            if stage == 3:
                param_shapes = load_checkpoint_file(rank_files[("model", 0, 0)][0])[PARAM_SHAPES]
                fragments = zero3_rank_fragments(optim_sd, param_shapes, dist.get_world_size(), dp_index)
            else:
                fragments = zero_rank_fragments(optim_sd, 0, [])
            fragments = list(fragments)
            names = [name for name, _, _, _ in fragments]
            assert len(names) == len(set(names)), f"a parameter with two fragments on rank {dp_index}: {names}"
            index_fragments(index, fragments, 0, dp_index)
        reader = FragmentReader(index)

        assert sorted(name for name in index if name in expected) == sorted(expected)
        for name, states in expected.items():
            numel = states["fp32"].numel()
            assert sum(fragment[2] for fragment in index[name][0].values()) == numel, name
            assert reader.state_names(name) == sorted(states), name
            for key, tensor in states.items():
                assert torch.equal(reader.read(name, key, 0, 0, numel).view(tensor.shape), tensor), f"{name} {key}"
