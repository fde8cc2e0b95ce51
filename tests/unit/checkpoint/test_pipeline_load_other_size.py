# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``engine.load_checkpoint()`` of a ``PipelineModule`` checkpoint (ZeRO-1) saved at another
pipeline-parallel and data-parallel size loads it as it is, with its optimizer states: no
``ds_to_universal``. Each rank reads the states of each of its parameters from the optimizer files
of the stage that saved it; a tied module's from the first stage that uses it, whose weights the
other stages are given at every load.

The model ties its input projection to its output projection (``TiedLayerSpec``), whose bias only
the first stage uses. On two ranks it is saved at pipeline-parallel size 2 (data-parallel size 1)
and loaded at size 1 (data-parallel size 2), and the reverse, with the same global batch of two
micro-batches. On four ranks it is saved at pipeline-parallel size 2 and data-parallel size 2, and
loaded on two ranks at data-parallel size 1 and on one rank at pipeline-parallel size 1. Right
after the load every parameter's weights, fp32 weights and Adam moments are those that the first
stage holding it saved, and the next two losses are those of the run that went on uninterrupted,
within reduction-order noise.

Before, such a load was refused ("pipeline parallelism is not supported", or the pipeline-parallel
size), and on deepspeed 0.19.8 it failed after the module's weights had been overwritten.
"""

import os

import pytest
import torch

import deepspeed.comm as dist

from unit.checkpoint.test_pipeline_tied_universal import HIDDEN, TAG, param_states, tied_pipeline_engine
from unit.common import DistributedTest

MICRO_BATCHES = 2


@pytest.fixture(scope="module")
def save_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("pipeline_four_ranks"))


def pipeline_engine(num_stages, bf16=False):
    """The tied model at pipeline-parallel size ``num_stages``, with a global batch of
    ``MICRO_BATCHES`` micro-batches whatever the data-parallel size."""
    data_parallel_size = dist.get_world_size() // num_stages
    return tied_pipeline_engine(num_stages, gradient_accumulation_steps=MICRO_BATCHES // data_parallel_size, bf16=bf16)


def train_step(engine, step):
    """One step on the global batch of ``step``: each data-parallel rank takes its share of the
    micro-batches."""
    micro_batches = []
    dtype = next(engine.module.parameters()).dtype
    for index in range(MICRO_BATCHES):
        generator = torch.Generator().manual_seed(step * MICRO_BATCHES + index)
        micro_batches.append(tuple(torch.randn(2, HIDDEN, generator=generator).to(dtype) for _ in range(2)))
    data_parallel_rank = engine.grid.get_data_parallel_rank()
    data_parallel_size = engine.grid.get_data_parallel_world_size()
    return engine.train_batch(iter(micro_batches[data_parallel_rank::data_parallel_size])).item()


def save(save_dir, num_stages, bf16=False):
    """Save after two steps at pipeline-parallel size ``num_stages``: the saved states and the next two
    losses of the run that goes on."""
    engine = pipeline_engine(num_stages, bf16)
    for step in range(2):
        train_step(engine, step)
    engine.save_checkpoint(save_dir, tag=TAG)
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, (engine.stage_id, param_states(engine)))
    return dict(found), [train_step(engine, step) for step in (2, 3)]


def load_and_compare(save_dir, num_stages, saved_by_stage, next_losses, bf16=False):
    """Load at pipeline-parallel size ``num_stages``: each parameter's states must be those its stage
    saved, at another pipeline-parallel size those of the first stage that saved it: the last stage's
    copy of the tied bias, which that stage does not use, does not train."""
    loaded = pipeline_engine(num_stages, bf16)
    loaded.load_checkpoint(save_dir, tag=TAG)
    saved = saved_by_stage[loaded.stage_id] if len(saved_by_stage) == num_stages else {}
    for stage in sorted(saved_by_stage):
        for name, tensors in saved_by_stage[stage].items():
            saved.setdefault(name, tensors)
    for name, tensors in param_states(loaded).items():
        for kind, tensor, saved_tensor in zip(("weight", "fp32", "exp_avg", "exp_avg_sq"), tensors, saved[name]):
            assert torch.equal(tensor, saved_tensor), f"{name} {kind}"
    assert loaded.global_steps == 2
    losses = [train_step(loaded, step) for step in (2, 3)]
    assert losses == pytest.approx(next_losses, rel=1e-5)


class TestPipelineLoadOtherSize(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("saved_stages, stages, bf16", [(2, 1, False), (1, 2, False), (2, 1, True)])
    def test_resumes(self, saved_stages, stages, bf16, tmpdir):
        saved, next_losses = save(str(tmpdir), saved_stages, bf16)
        load_and_compare(str(tmpdir), stages, saved, next_losses, bf16)

    @pytest.mark.world_size(4)
    def test_save_on_4_ranks(self, save_dir):
        saved, next_losses = save(save_dir, 2)
        if dist.get_rank() == 0:
            torch.save((saved, next_losses), os.path.join(save_dir, "expected.pt"))
        dist.barrier()

    def test_load_on_2_ranks(self, save_dir):
        load_and_compare(save_dir, 2, *torch.load(os.path.join(save_dir, "expected.pt")))

    @pytest.mark.world_size(1)
    def test_load_on_1_rank(self, save_dir):
        load_and_compare(save_dir, 1, *torch.load(os.path.join(save_dir, "expected.pt")))
