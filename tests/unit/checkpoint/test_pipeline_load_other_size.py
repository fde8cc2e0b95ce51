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
micro-batches. Right after the load every parameter's weights, fp32 weights and Adam moments are
those that the first stage holding it saved, and the next two losses are those of the run that
went on uninterrupted, within reduction-order noise.

Before, such a load was refused ("pipeline parallelism is not supported", or the pipeline-parallel
size), and on deepspeed 0.19.8 it failed after the module's weights had been overwritten.
"""

import pytest
import torch

import deepspeed.comm as dist

from unit.checkpoint.test_pipeline_tied_universal import (HIDDEN, TAG, first_stage_states, param_states,
                                                          tied_pipeline_engine)
from unit.common import DistributedTest

MICRO_BATCHES = 2


def pipeline_engine(num_stages):
    """The tied model at pipeline-parallel size ``num_stages``, with a global batch of
    ``MICRO_BATCHES`` micro-batches whatever the data-parallel size."""
    data_parallel_size = dist.get_world_size() // num_stages
    return tied_pipeline_engine(num_stages, gradient_accumulation_steps=MICRO_BATCHES // data_parallel_size)


def train_step(engine, step):
    """One step on the global batch of ``step``: each data-parallel rank takes its share of the
    micro-batches."""
    micro_batches = []
    for index in range(MICRO_BATCHES):
        generator = torch.Generator().manual_seed(step * MICRO_BATCHES + index)
        micro_batches.append((torch.randn(2, HIDDEN, generator=generator), torch.randn(2, HIDDEN,
                                                                                       generator=generator)))
    data_parallel_rank = engine.grid.get_data_parallel_rank()
    data_parallel_size = engine.grid.get_data_parallel_world_size()
    return engine.train_batch(iter(micro_batches[data_parallel_rank::data_parallel_size])).item()


class TestPipelineLoadOtherSize(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("saved_stages, stages", [(2, 1), (1, 2)])
    def test_resumes(self, saved_stages, stages, tmpdir):
        save_dir = str(tmpdir)
        engine = pipeline_engine(saved_stages)
        for step in range(2):
            train_step(engine, step)
        engine.save_checkpoint(save_dir, tag=TAG)
        saved = first_stage_states(engine)
        next_losses = [train_step(engine, step) for step in (2, 3)]

        loaded = pipeline_engine(stages)
        loaded.load_checkpoint(save_dir, tag=TAG)
        for name, tensors in param_states(loaded).items():
            for kind, tensor, saved_tensor in zip(("weight", "fp32", "exp_avg", "exp_avg_sq"), tensors, saved[name]):
                assert torch.equal(tensor, saved_tensor), f"{name} {kind}"
        assert loaded.global_steps == 2
        losses = [train_step(loaded, step) for step in (2, 3)]
        assert losses == pytest.approx(next_losses, rel=1e-5)
