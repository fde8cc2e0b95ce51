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

import deepspeed
import deepspeed.comm as dist
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

from unit.common import DistributedTest

HIDDEN = 16
TAG = "step2"
MICRO_BATCHES = 2


def pipeline_engine(num_stages):
    """The tied model on two ranks at pipeline-parallel size ``num_stages``, with a global batch of
    ``MICRO_BATCHES`` micro-batches whatever the data-parallel size."""
    torch.manual_seed(0)
    layers = [TiedLayerSpec("embed", torch.nn.Linear, HIDDEN, HIDDEN)]
    layers += [LayerSpec(torch.nn.Linear, HIDDEN, HIDDEN) for _ in range(4)]
    layers += [TiedLayerSpec("embed", torch.nn.Linear, HIDDEN, HIDDEN, forward_fn=lambda embed, x: x @ embed.weight)]
    model = PipelineModule(layers=layers, num_stages=num_stages, loss_fn=torch.nn.MSELoss())
    data_parallel_size = dist.get_world_size() // num_stages
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": MICRO_BATCHES // data_parallel_size,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-2,
                "torch_adam": True
            }
        },
        "zero_optimization": {
            "stage": 1
        },
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


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


def param_states(engine):
    return {
        name: [
            param.detach().clone(),
            safe_get_full_fp32_param(param),
            safe_get_full_optimizer_state(param, "exp_avg"),
            safe_get_full_optimizer_state(param, "exp_avg_sq")
        ]
        for name, param in engine.module.named_parameters()
    }


def first_stage_states(engine):
    """Each parameter's states on the first rank that holds it."""
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, param_states(engine))
    states = {}
    for rank_states in found:
        for name, tensors in rank_states.items():
            states.setdefault(name, tensors)
    return states


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
