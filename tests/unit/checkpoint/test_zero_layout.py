# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``deepspeed.checkpoint.zero_layout`` says where each element of every parameter's saved states lies
in the optimizer files of a ZeRO checkpoint: ``param_slice_mappings`` at ZeRO-1/2, ``param_shapes``
and the partitioning rule at ZeRO-3. ``ds_to_universal`` reads the rank files through it, and
``zero_to_fp32`` takes the ZeRO-3 partitioning rule from it.

A 2-rank job trains a small Llama with the Hugging Face Trainer's two parameter groups and a
zero-element placeholder, and saves it. Cut out of the rank files through the layout, every
parameter's fp32 weights and Adam moments must come out whole, each element from exactly one
fragment, equal to what the engine gathers from its ranks and to what ``zero_to_fp32``
consolidates.
"""

import os

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, PARAM_SHAPES
from deepspeed.checkpoint.rank_files import find_rank_files
from deepspeed.checkpoint.zero_layout import zero3_rank_fragments, zero_rank_fragments
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from unit.checkpoint.autotp_common import build_model, ds_config, train_engine, trainer_param_groups
from unit.common import DistributedTest

STATES = ("fp32", "exp_avg", "exp_avg_sq")


def gathered_states(engine):
    states = {}
    for name, param in engine.module.named_parameters():
        if getattr(param, "ds_numel", param.numel()) == 0:
            continue  # nothing to optimize, no optimizer state
        states[name] = {"fp32": safe_get_full_fp32_param(param).detach().cpu().clone()}
        for key in STATES[1:]:
            states[name][key] = safe_get_full_optimizer_state(param, key).detach().cpu().clone()
    return states


@pytest.mark.parametrize("stage", [1, 2, 3])
class TestZeroLayout(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test_every_element_in_one_fragment(self, stage, tmpdir):
        model = build_model()
        # A zero-element parameter, as quantization libraries register for placeholders.
        model.model.norm.register_parameter("weight_scale", torch.nn.Parameter(torch.zeros(0)))
        engine, _, _, _ = deepspeed.initialize(model=model,
                                               config=ds_config(stage, tp_size=1),
                                               model_parameters=trainer_param_groups(model))
        train_engine(engine, tp_size=1, steps=2)
        engine.save_checkpoint(str(tmpdir), tag="step2")
        expected = gathered_states(engine)
        engine.destroy()
        if dist.get_rank() != 0:
            return

        rank_files = find_rank_files(os.path.join(str(tmpdir), "step2"))
        pieces = {}
        for dp_index in range(dist.get_world_size()):
            optim_sd = torch.load(rank_files[("optim", dp_index, 0)][0], weights_only=False)[OPTIMIZER_STATE_DICT]
            if stage == 3:
                param_shapes = torch.load(rank_files[("model", 0, 0)][0], weights_only=False)[PARAM_SHAPES]
                fragments = zero3_rank_fragments(optim_sd, param_shapes, dist.get_world_size(), dp_index)
            else:
                fragments = zero_rank_fragments(optim_sd, 0, [])
            fragments = list(fragments)
            names = [name for name, _, _, _ in fragments]
            assert len(names) == len(set(names)), f"a parameter with two fragments on rank {dp_index}: {names}"
            for name, flat_state, start, numel in fragments:
                pieces.setdefault(name, []).append({key: flat_state[key].narrow(0, start, numel) for key in STATES})

        assert sorted(name for name in pieces if name in expected) == sorted(expected)
        for name, states in expected.items():
            for key, tensor in states.items():
                merged = torch.cat([piece[key] for piece in pieces[name]])
                assert merged.numel() == tensor.numel(), f"{name} {key}"
                assert torch.equal(merged.view(tensor.shape), tensor), f"{name} {key}"

        consolidated = get_fp32_state_dict_from_zero_checkpoint(str(tmpdir), tag="step2")
        for name, states in expected.items():
            assert torch.equal(consolidated[name].float(), states["fp32"].view(consolidated[name].shape)), name
