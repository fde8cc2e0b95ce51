# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``load_checkpoint()`` of a pipeline-parallel or MoE checkpoint at another pipeline-parallel or
expert-parallel size, with its optimizer states, is refused on every rank before anything is
loaded, naming the sizes it was saved at and is loaded at; its weights alone then load exactly.

Each rank's optimizer states hold the parameters of its own pipeline stage and experts, which
another size gives to other ranks. Covered, on two ranks, without ZeRO (with ZeRO each rank reads
its parameters' states from the files of the ranks that saved them): a ``PipelineModule`` of four
layers at pipeline-parallel size 2 -> 1 and 1 -> 2, and legacy ``deepspeed.moe`` MoE of four
experts at expert-parallel size 2 -> 1. AutoEP's ZeRO-3 experts, whose weights are read
from the optimizer states, are refused without the optimizer states too (2 -> 1).

On deepspeed 0.19.8 these loads raise once the module's weights have been overwritten, for another
reason (ZeRO's data-parallel size, or the size of a parameter group of torch's optimizer).
"""

import re

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.utils import groups

from unit.common import DistributedTest

HIDDEN = 16
NUM_EXPERTS = 4
TAG = "step1"


def config(stage):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-2,
                "torch_adam": True
            }
        },
        "zero_optimization": {
            "stage": stage
        },
    }


def batch(seed):
    generator = torch.Generator().manual_seed(seed + dist.get_rank())
    return torch.randn(2, HIDDEN, generator=generator), torch.randn(2, HIDDEN, generator=generator)


class MoEModel(torch.nn.Module):

    def __init__(self, ep_size):
        super().__init__()
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN)
        # Tokens over an expert's capacity are dropped in their order, not at random: runs at two
        # expert-parallel sizes, whose random number streams differ, then take the same steps.
        self.moe = MoE(hidden_size=HIDDEN,
                       expert=torch.nn.Linear(HIDDEN, HIDDEN),
                       num_experts=NUM_EXPERTS,
                       ep_size=ep_size,
                       k=1,
                       min_capacity=0,
                       use_rts=False)

    def forward(self, x, y):
        hidden, _, _ = self.moe(self.linear(x))
        return torch.nn.functional.mse_loss(hidden, y)


class SparseMoeBlock(torch.nn.Module):
    """What AutoEP's "mixtral" preset replaces: transformers' Mixtral sparse MoE block."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(HIDDEN, NUM_EXPERTS, bias=False)
        self.experts = torch.nn.Module()
        self.experts.gate_up_proj = torch.nn.Parameter(torch.randn(NUM_EXPERTS, 2 * HIDDEN, HIDDEN) * 0.1)
        self.experts.down_proj = torch.nn.Parameter(torch.randn(NUM_EXPERTS, HIDDEN, HIDDEN) * 0.1)
        self.top_k = 2


class MixtralLike(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.config = type(
            "MixtralConfig", (), {
                "model_type": "mixtral",
                "num_local_experts": NUM_EXPERTS,
                "num_experts_per_tok": 2,
                "hidden_size": HIDDEN,
                "intermediate_size": HIDDEN
            })()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.model.layers[0].mlp = SparseMoeBlock()
        self.lm_head = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, y):
        hidden = x + self.model.layers[0].mlp(x.unsqueeze(0)).squeeze(0)
        return torch.nn.functional.mse_loss(self.lm_head(hidden), y)


def make_engine(kind, size, stage, load_universal=False, bf16=False):
    """An engine of ``kind`` at pipeline-parallel (pipeline) or expert-parallel (moe, autoep) ``size``."""
    torch.manual_seed(0)
    ds_config = config(stage)
    ds_config["checkpoint"] = {"load_universal": load_universal}
    ds_config["bf16"] = {"enabled": bf16}
    if kind == "pipeline":
        model = PipelineModule(layers=[LayerSpec(torch.nn.Linear, HIDDEN, HIDDEN) for _ in range(4)],
                               num_stages=size,
                               loss_fn=torch.nn.MSELoss())
        params = model.parameters()
    elif kind == "moe":
        model = MoEModel(size)
        params = split_params_into_different_moe_groups_for_optimizer({
            "name": "params",
            "params": list(model.parameters())
        })
    else:
        model = MixtralLike()
        params = None
        ds_config["expert_parallel"] = {
            "enabled": True,
            "autoep_size": size,
            "preset_model": "mixtral",
            "use_grouped_mm": False
        }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=ds_config)
    return engine


def train_step(engine, seed):
    if isinstance(engine.module, PipelineModule):
        engine.train_batch(iter([batch(seed)]))
    else:
        engine.backward(engine(*batch(seed)))
        engine.step()


def weights_by_global_name(engine):
    """The module's weights on this rank, each expert named by its global id."""
    weights = {}
    for module_name, module in engine.module.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if isinstance(module, MoE):
            first = groups._get_expert_parallel_rank(module.expert_group_name) * module.num_local_experts
            for name, tensor in module.state_dict().items():
                name = re.sub(r"deepspeed_experts\.(\d+)", lambda m: f"deepspeed_experts.{first + int(m.group(1))}",
                              name)
                weights[prefix + name] = tensor
        elif isinstance(module, AutoEPMoELayer):
            first = module.ep_rank * module.num_local_experts
            for name, tensor in module.state_dict().items():
                if name.startswith("experts."):
                    for local_id, expert in enumerate(tensor):
                        weights[f"{prefix}{name}.{first + local_id}"] = expert
                else:
                    weights[prefix + name] = tensor
    for name, tensor in engine.module.state_dict().items():
        if "expert" not in name:
            weights[name] = tensor
    return {name: tensor.detach().clone() for name, tensor in weights.items()}


def all_weights(engine):
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, weights_by_global_name(engine))
    return {name: tensor for rank_weights in found for name, tensor in rank_weights.items()}


def tensors(state):
    if torch.is_tensor(state):
        return [state.clone()]
    if isinstance(state, dict):
        return [tensor for key in sorted(state, key=str) for tensor in tensors(state[key])]
    if isinstance(state, (list, tuple)):
        return [tensor for item in state for tensor in tensors(item)]
    return []


def training_state(engine):
    """The weights and every tensor of the optimizer's state: its fp32 weights and Adam's moments."""
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        weights = [param.detach().clone() for param in params]
    return weights + tensors(engine.optimizer.state_dict())


class TestLoadAtOtherPipelineOrExpertSize(DistributedTest):
    world_size = 2
    reuse_dist_env = True
    # A rank left waiting for another that raised fails the test here, not after the default 600 s.
    exec_timeout = 120

    @pytest.mark.parametrize("kind, stage, saved_size, size", [("pipeline", 0, 2, 1), ("pipeline", 0, 1, 2),
                                                               ("moe", 0, 2, 1)])
    def test_refused_then_weights_load(self, kind, stage, saved_size, size, tmpdir):
        save_dir = str(tmpdir)
        engine = make_engine(kind, saved_size, stage)
        train_step(engine, seed=0)
        engine.save_checkpoint(save_dir, tag=TAG)
        saved_weights = all_weights(engine)

        fresh = make_engine(kind, size, stage)
        train_step(fresh, seed=1)
        before = training_state(fresh)
        axis = "pipeline-parallel" if kind == "pipeline" else "expert-parallel"
        with pytest.raises(RuntimeError,
                           match=f"saved at {axis} size {saved_size}, at {axis} size {size}:.*"
                           f"Nothing was loaded; load it at {axis} size {saved_size}, or its weights alone"):
            fresh.load_checkpoint(save_dir, tag=TAG)
        after = training_state(fresh)
        assert len(after) == len(before)
        assert all(torch.equal(a, b) for a, b in zip(after, before))

        fresh.load_checkpoint(save_dir, tag=TAG, load_optimizer_states=False, load_lr_scheduler_states=False)
        for name, tensor in weights_by_global_name(fresh).items():
            assert torch.equal(tensor, saved_weights[name]), name

    def test_autoep_zero3_refused_without_optimizer_states(self, tmpdir):
        save_dir = str(tmpdir)
        engine = make_engine("autoep", 2, 3)
        train_step(engine, seed=0)
        engine.save_checkpoint(save_dir, tag=TAG)

        fresh = make_engine("autoep", 1, 3)
        train_step(fresh, seed=1)
        before = training_state(fresh)
        with pytest.raises(
                RuntimeError,
                match="saved at expert-parallel size 2, at expert-parallel size 1:.*"
                "Nothing was loaded; load it at expert-parallel size 2, or convert it with ds_to_universal"):
            fresh.load_checkpoint(save_dir, tag=TAG, load_optimizer_states=False)
        after = training_state(fresh)
        assert all(torch.equal(a, b) for a, b in zip(after, before))
