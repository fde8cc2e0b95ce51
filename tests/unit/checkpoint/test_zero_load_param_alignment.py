# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A ZeRO-1/2 checkpoint saved with ``"parameter_alignment": true`` loads at another data-parallel
size with every parameter's own weights and optimizer states.

``parameter_alignment`` pads each parameter of odd size in the flat buffers that the ranks
partition, so a parameter's elements lie further along in each rank file than the partitioning rule
without the paddings says. A model of odd layer sizes, torch's Adam, saved at 4 ranks after two
steps and loaded at 1 and 2: right after the load every fp32 weight equals what ``zero_to_fp32``
reads from the checkpoint, Adam's moments equal the saved run's, and the next two losses are those
of the run that went on uninterrupted.

Before, the load placed the fragments by the rule without the paddings and compared that with the
first rank file only, which holds part of the first parameter alone: 5 of the 6 parameters got
other elements' weights and moments, silently.
"""

import json
import os

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from unit.checkpoint.autotp_common import run_source_test
from unit.common import DistributedTest

TAG = "step2"
GLOBAL_BATCH = 4
CACHE_ENV = "DS_TEST_ZERO_PARAM_ALIGNMENT_CACHE"


def initialize(stage):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 43), torch.nn.ReLU(), torch.nn.Linear(43, 5), torch.nn.Linear(5, 3))
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_clipping": 0.0,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-2,
                "torch_adam": True
            }
        },
        "zero_optimization": {
            "stage": stage,
            "parameter_alignment": True
        },
    }
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    return engine


def train(engine, steps, first_step=0):
    """The losses of the global batches ``first_step`` onwards, each rank training on its slice."""
    losses = []
    for step in range(first_step, first_step + steps):
        generator = torch.Generator().manual_seed(step)
        inputs = torch.randn(GLOBAL_BATCH, 7, generator=generator)
        targets = torch.randn(GLOBAL_BATCH, 3, generator=generator)
        per_rank = GLOBAL_BATCH // dist.get_world_size()
        rank_slice = slice(dist.get_rank() * per_rank, (dist.get_rank() + 1) * per_rank)
        loss = (engine(inputs[rank_slice]) - targets[rank_slice]).pow(2).mean()
        engine.backward(loss)
        engine.step()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        losses.append(reduced.item() / dist.get_world_size())
    return losses


def gathered_states(engine):
    return {
        name: {
            "fp32": safe_get_full_fp32_param(param).clone(),
            **{
                key: safe_get_full_optimizer_state(param, key).clone()
                for key in ("exp_avg", "exp_avg_sq")
            }
        }
        for name, param in engine.module.named_parameters()
    }


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    return os.environ.get(CACHE_ENV) or str(tmp_path_factory.mktemp("zero_param_alignment"))


@pytest.fixture
def saved(request, cache):
    """The folder of the checkpoint of the test's ZeRO stage, saved at 4 ranks."""
    folder = os.path.join(cache, f"stage{request.getfixturevalue('stage')}")
    if not os.path.isfile(os.path.join(folder, "done.json")):
        run_source_test(request, f"TestSave::test[{request.getfixturevalue('stage')}]", CACHE_ENV, cache,
                        os.path.join(folder, "done.json"))
    return folder


@pytest.mark.parametrize("stage", [1, 2])
class TestSave(DistributedTest):
    world_size = 4
    reuse_dist_env = True

    def test(self, stage, cache):
        folder = os.path.join(cache, f"stage{stage}")
        engine = initialize(stage)
        train(engine, 2)
        engine.save_checkpoint(folder, tag=TAG)
        states = gathered_states(engine)
        losses = train(engine, 2, first_step=2)
        if dist.get_rank() == 0:
            torch.save(states, os.path.join(folder, "states.pt"))
            with open(os.path.join(folder, "done.json"), "w") as f:
                json.dump({"losses": losses}, f)
        dist.barrier()


@pytest.mark.parametrize("stage", [1, 2])
class TestLoad(DistributedTest):
    world_size = [1, 2]
    reuse_dist_env = True

    def test(self, stage, saved):
        engine = initialize(stage)
        load_path, _ = engine.load_checkpoint(saved, tag=TAG)
        assert load_path is not None
        states = gathered_states(engine)
        expected = torch.load(os.path.join(saved, "states.pt"))
        fp32 = get_fp32_state_dict_from_zero_checkpoint(saved, tag=TAG)
        assert sorted(states) == sorted(expected)
        for name, param_states in states.items():
            assert torch.equal(param_states["fp32"], fp32[name]), name
            for key, value in param_states.items():
                assert torch.equal(value, expected[name][key]), f"{name} {key}"
        losses = train(engine, 2, first_step=2)
        with open(os.path.join(saved, "done.json")) as f:
            assert losses == pytest.approx(json.load(f)["losses"], rel=1e-5)
