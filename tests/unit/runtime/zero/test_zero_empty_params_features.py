# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Zero-element parameters on every ZeRO feature path: ``zero.Init``, prefetch, CPU parameter and
optimizer offload, ``offload_states``/``reload_states``, hpZ and ``stage3_module_granularity_threshold``.

On deepspeed 0.19.8 each of these stops at ZeRO-3's fetch assert (``'status': 'NOT_AVAILABLE'``,
``'numel': 0``) or, at world size 2, at ``torch.cat(): expected a non-empty list of Tensors``.
CPU optimizer offload at stages 1 and 2 already works on 0.19.8 and is covered so that it stays
working. The model holds all four shapes of ``test_zero_empty_params`` at once; each run trains a
few steps and is compared with the same model trained without the feature.
"""

import pytest
import torch
import torch.nn as nn

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from unit.common import DistributedTest
from unit.runtime.zero.test_zero_empty_params import (HIDDEN, MODELS, zero_config)

STEPS = 3


class AllShapesModel(nn.Module):
    """Every zero-element shape at once, each in its own submodule."""

    def __init__(self):
        super().__init__()
        self.parts = nn.ModuleList([model_cls() for model_cls in MODELS.values()])

    def forward(self, x):
        return sum(part(x) for part in self.parts)


def feature_config(feature, stage, dtype):
    config = zero_config(stage, dtype)
    zero = config["zero_optimization"]
    if feature == "prefetch":
        # Small buckets and no persistence, so every submodule is fetched and prefetched separately.
        zero.update(stage3_prefetch_bucket_size=10,
                    stage3_max_live_parameters=10,
                    stage3_param_persistence_threshold=0)
    elif feature == "offload_optimizer":
        zero["offload_optimizer"] = {"device": "cpu"}
        config["zero_force_ds_cpu_optimizer"] = False
    elif feature == "offload_param":
        zero["offload_param"] = {"device": "cpu"}
        zero["offload_optimizer"] = {"device": "cpu"}
        config["zero_force_ds_cpu_optimizer"] = False
    elif feature == "hpz":
        zero["zero_hpz_partition_size"] = 2
    elif feature == "module_granularity":
        # Small enough to make the parts (not the whole model) leaf modules fetched as one unit.
        zero["stage3_module_granularity_threshold"] = 200
    return config


def train(feature, stage, dtype, enabled=True):
    """Loss per step and the trained parameters (gathered, fp32, on CPU) by name.

    ``enabled=False`` trains the same model with the same optimizer without the feature.
    """
    torch.manual_seed(42)
    config = feature_config(feature if enabled else None, stage, dtype)
    if feature == "offload_states":
        # offload_states() supports DeepSpeed's fused Adam only; the reference uses it too.
        config["optimizer"]["params"]["torch_adam"] = False
    if feature == "zero_init" and enabled:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = AllShapesModel()
    else:
        model = AllShapesModel()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    generator = torch.Generator().manual_seed(7)
    losses = []
    for step in range(STEPS):
        if feature == "offload_states" and enabled and step == STEPS - 1:
            engine.offload_states()
            engine.reload_states()
        # 3-D, like a batch of sequences: zero.Init's linear folds the leading dimensions in backward.
        loss = engine(torch.randn(2, 3, HIDDEN, generator=generator).to(engine.device, dtype))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = {}
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            params[name] = param.detach().float().cpu().clone()
        if stage == 3:
            # Zero-element parameters are never partitioned, so never released either.
            expected = ZeroParamStatus.AVAILABLE if param.ds_numel == 0 else ZeroParamStatus.NOT_AVAILABLE
            assert param.ds_status == expected, param.ds_summary()
    return losses, params


FEATURE_STAGES = [
    ("zero_init", 3),
    ("prefetch", 3),
    ("offload_optimizer", 1),
    ("offload_optimizer", 2),
    ("offload_optimizer", 3),
    ("offload_param", 3),
    ("offload_states", 3),
    ("hpz", 3),
    ("module_granularity", 3),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("feature,stage", FEATURE_STAGES, ids=[f"{f}-stage{s}" for f, s in FEATURE_STAGES])
class TestZeroEmptyParamsFeatures(DistributedTest):
    world_size = [1, 2]
    reuse_dist_env = True

    def test(self, feature, stage, dtype):
        if dtype == torch.bfloat16 and not get_accelerator().is_bf16_supported():
            pytest.skip("bf16 is not supported on this accelerator")
        if feature == "hpz" and dist.get_world_size() < 2:
            pytest.skip("hpZ needs a secondary partition of at least two ranks")
        losses, params = train(feature, stage, dtype)
        shapes = {name: tuple(p.shape) for name, p in AllShapesModel().named_parameters()}
        assert {name: tuple(p.shape) for name, p in params.items()} == shapes
        assert all(torch.isfinite(torch.tensor(losses))), losses
        # The feature changes where states live and how they move, not what is computed.
        base_losses, base_params = train(feature, stage, dtype, enabled=False)
        tolerance = dict(rel=1e-5, abs=1e-6) if dtype == torch.float32 else dict(rel=2e-2, abs=2e-2)
        assert losses == pytest.approx(base_losses, **tolerance)
        for name, value in params.items():
            assert value.numpy() == pytest.approx(base_params[name].numpy(), **tolerance), name
