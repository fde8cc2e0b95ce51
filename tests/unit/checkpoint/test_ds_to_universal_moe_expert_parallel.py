# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A checkpoint of ``deepspeed.moe`` layers converts with ``ds_to_universal`` at any expert-parallel
size, and its universal checkpoint loads exactly at any expert-parallel size: four experts, ZeRO-2,
saved on two ranks at expert-parallel size 2 or 1 and loaded at 1 or 2, or on one rank, and saved
on four ranks at size 2 and loaded at 4. Right after the load every parameter's weights, fp32
weights and Adam moments are those saved for the same expert, and the next losses are those of the
run that went on uninterrupted.

Each expert-parallel rank names the parameters of its experts by their index on that rank; the
universal checkpoint names them by their global id, as the expert files do. Before, the conversion
of a checkpoint saved at size 2 failed with "shape '[16]' is invalid for input of size 32", where
the two ranks' first experts (global ids 0 and 2) shared a name, and a universal checkpoint loaded at
size 2 gave rank 1 the states of experts 0 and 1 in place of 2 and 3.
"""

import os
import re

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
from deepspeed.moe.layer import MoE
from deepspeed.utils import groups

from unit.checkpoint.autotp_common import convert_to_universal_checkpoint
from unit.checkpoint.test_pipeline_moe_other_topology import TAG, batch, make_engine
from unit.checkpoint.test_pipeline_tied_universal import param_states
from unit.common import DistributedTest


@pytest.fixture(scope="module")
def save_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("moe_universal"))


def step(engine, seed):
    dtype = next(engine.module.parameters()).dtype
    loss = engine(*(tensor.to(dtype) for tensor in batch(seed)))
    engine.backward(loss)
    engine.step()
    return loss.detach()


def states_by_global_name(engine):
    """Each parameter's weights, fp32 weights and Adam moments, on any rank, each expert's by its
    global id: those of AutoEP's experts, which lie one after the other in one tensor, expert by
    expert."""
    first_expert = {}
    for name, module in engine.module.named_modules():
        if isinstance(module, MoE):
            first_expert[name] = groups._get_expert_parallel_rank(module.expert_group_name) * module.num_local_experts
        elif isinstance(module, AutoEPMoELayer):
            first_expert[name] = module.ep_rank * module.num_local_experts
    states = {}
    for name, tensors in param_states(engine).items():
        match = re.match(r"(.*)\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(.*)", name)
        autoep_module = name.rpartition(".experts.")[0]
        if match:
            module_name, local_id, param_name = match.groups()
            name = (f"{module_name}.deepspeed_moe.experts.deepspeed_experts."
                    f"{first_expert[module_name] + int(local_id)}.{param_name}")
        elif autoep_module in first_expert:
            for local_id in range(tensors[0].shape[0]):
                states[f"{name}.{first_expert[autoep_module] + local_id}"] = [tensor[local_id] for tensor in tensors]
            continue
        states[name] = tensors
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, states)
    return {name: tensors for rank_states in found for name, tensors in rank_states.items()}


def assert_states_equal(states, saved):
    assert sorted(states) == sorted(saved)
    for name, tensors in states.items():
        for kind, tensor, saved_tensor in zip(("weight", "fp32", "exp_avg", "exp_avg_sq"), tensors, saved[name]):
            assert torch.equal(tensor, saved_tensor), f"{name} {kind}"


def save(save_dir, kind, saved_size, bf16=False):
    """Save ``kind`` at expert-parallel size ``saved_size``: the saved states and the next two losses of
    the run that goes on."""
    engine = make_engine(kind, saved_size, 2, bf16=bf16)
    step(engine, seed=0)
    engine.save_checkpoint(save_dir, tag=TAG)
    saved = states_by_global_name(engine)
    return saved, [step(engine, seed) for seed in (1, 2)]


def save_and_convert(save_dir, saved_size):
    """Save deepspeed.moe at expert-parallel size ``saved_size`` and convert it with ds_to_universal."""
    saved, next_losses = save(save_dir, "moe", saved_size)
    if dist.get_rank() == 0:
        convert_to_universal_checkpoint(os.path.join(save_dir, TAG),
                                        os.path.join(save_dir, "universal"),
                                        inject_missing_state=True)
    dist.barrier()
    return saved, next_losses


def load_and_compare(save_dir, tag, kind, size, saved, next_losses, bf16=False):
    """Load ``tag`` (the universal checkpoint: "universal") into ``kind`` at expert-parallel size
    ``size``: the states must be ``saved``, the next losses ``next_losses``."""
    loaded = make_engine(kind, size, 2, load_universal=tag == "universal", bf16=bf16)
    loaded.load_checkpoint(save_dir, tag=tag)
    assert_states_equal(states_by_global_name(loaded), saved)
    losses = [step(loaded, seed) for seed in (1, 2)][:len(next_losses)]
    assert torch.allclose(torch.stack(losses), torch.stack(next_losses), rtol=1e-5, atol=0)


class TestMoEUniversalOtherExpertParallelSize(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("saved_size, size", [(2, 1), (1, 2)])
    def test_loads_exactly(self, saved_size, size, tmpdir):
        saved, next_losses = save_and_convert(str(tmpdir), saved_size)
        load_and_compare(str(tmpdir), "universal", "moe", size, saved, next_losses)

    @pytest.mark.world_size(4)
    def test_loads_exactly_on_4_ranks(self, tmpdir):
        # Each expert-parallel rank's experts are partitioned over two ranks at the saving size.
        saved, next_losses = save_and_convert(str(tmpdir), 2)
        load_and_compare(str(tmpdir), "universal", "moe", 4, saved, next_losses)

    def test_save_on_2_ranks(self, save_dir):
        saved, next_losses = save_and_convert(save_dir, 2)
        if dist.get_rank() == 0:
            torch.save((saved, next_losses), os.path.join(save_dir, "expected.pt"))
        dist.barrier()

    @pytest.mark.world_size(1)
    def test_load_on_1_rank(self, save_dir):
        saved, next_losses = torch.load(os.path.join(save_dir, "expected.pt"))
        # Its first batch is the one rank 0 of the saving run took next.
        load_and_compare(save_dir, "universal", "moe", 1, saved, next_losses[:1])
