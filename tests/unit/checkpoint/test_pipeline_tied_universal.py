# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``ds_to_universal`` converts a ``PipelineModule`` checkpoint as it is (no
``--inject_missing_state``), and the states of a tied module's parameters in the universal
checkpoint are those of the first stage that uses it.

The model ties its input projection to its output projection (``TiedLayerSpec``), whose bias only
the first stage uses, as a language model ties its token embeddings to its output head. Every
stage that uses the tied module saves its parameters and optimizer states; the first stage's are
the ones that train, and that ``_synchronize_tied_weights()`` gives the other stages at a load.
After a conversion of a checkpoint saved at pipeline-parallel size 2, a load at pipeline-parallel
size 2, and at size 1 (data-parallel size 2), gives every parameter the weights, fp32 weights and
Adam moments of the first stage that held it; at size 2 the next loss is that of the run that went
on uninterrupted.

On deepspeed 0.19.8 the conversion refuses the checkpoint without ``--inject_missing_state``, and
with it the tied bias comes from the last stage's unused copy.
"""

import os

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

from unit.checkpoint.autotp_common import convert_to_universal_checkpoint
from unit.common import DistributedTest

HIDDEN = 16
TAG = "step2"


def tied_pipeline_engine(num_stages, load_universal=False, gradient_accumulation_steps=1, bf16=False, hidden_layers=4):
    """``hidden_layers`` + 2 linear layers at pipeline-parallel size ``num_stages``, the first tied to
    the last, whose bias only the first stage uses."""
    torch.manual_seed(0)
    layers = [TiedLayerSpec("embed", torch.nn.Linear, HIDDEN, HIDDEN)]
    layers += [LayerSpec(torch.nn.Linear, HIDDEN, HIDDEN) for _ in range(hidden_layers)]
    layers += [TiedLayerSpec("embed", torch.nn.Linear, HIDDEN, HIDDEN, forward_fn=lambda embed, x: x @ embed.weight)]
    model = PipelineModule(layers=layers, num_stages=num_stages, loss_fn=torch.nn.MSELoss())
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gradient_accumulation_steps,
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
        "bf16": {
            "enabled": bf16
        },
        "checkpoint": {
            "load_universal": load_universal
        },
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def batch(step):
    generator = torch.Generator().manual_seed(step)
    return torch.randn(2, HIDDEN, generator=generator), torch.randn(2, HIDDEN, generator=generator)


def param_states(engine):
    """Each parameter's weights, fp32 weights and Adam moments on this rank."""
    states = {}
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            weights = param.detach().clone()
        states[name] = [weights, safe_get_full_fp32_param(param)]
        states[name] += [safe_get_full_optimizer_state(param, key) for key in ("exp_avg", "exp_avg_sq")]
    return states


def first_stage_states(engine):
    """Each parameter's states on the first rank that holds it."""
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, param_states(engine))
    states = {}
    for rank_states in found:
        for name, tensors in rank_states.items():
            states.setdefault(name, tensors)
    return states


class TestPipelineTiedUniversal(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("num_stages", [2, 1])
    def test_tied_states_of_the_first_stage(self, num_stages, tmpdir):
        save_dir = str(tmpdir)
        engine = tied_pipeline_engine(2)
        for step in range(2):
            engine.train_batch(iter([batch(step)]))
        engine.save_checkpoint(save_dir, tag=TAG)
        saved = first_stage_states(engine)
        if dist.get_rank() == 1:
            # The last stage does not use the bias: its copy did not train.
            bias = param_states(engine)["tied_modules.embed.bias"][0]
            assert not torch.equal(bias, saved["tied_modules.embed.bias"][0])
        next_loss = engine.train_batch(iter([batch(2)]))
        if dist.get_rank() == 0:
            convert_to_universal_checkpoint(os.path.join(save_dir, TAG), os.path.join(save_dir, "universal"))
        dist.barrier()

        loaded = tied_pipeline_engine(num_stages, load_universal=True)
        loaded.load_checkpoint(save_dir, tag="universal")
        for name, tensors in param_states(loaded).items():
            for kind, tensor, saved_tensor in zip(("weight", "fp32", "exp_avg", "exp_avg_sq"), tensors, saved[name]):
                assert torch.equal(tensor, saved_tensor), f"{name} {kind}"
        if num_stages == 2:
            assert torch.equal(loaded.train_batch(iter([batch(2)])), next_loss)
