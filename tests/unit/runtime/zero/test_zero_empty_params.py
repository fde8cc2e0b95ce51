# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Training with zero-element parameters under ZeRO stages 1, 2 and 3.

Models declare parameters with no elements: a classification head with zero labels, a
quantization placeholder (``nn.Parameter(torch.zeros(0))``), an adapter at rank 0. Under ZeRO-3
the fetch of a submodule whose pending parameters are all empty used to be skipped (its gate was
the number of elements to gather), and the forward failed with
``AssertionError: {... 'status': 'NOT_AVAILABLE', 'numel': 0 ...}``; at world size 2, a gather of
an empty parameter next to others failed with ``torch.cat(): expected a non-empty list of Tensors``.
Zero-element parameters are now never partitioned: they stay available on every rank and cost no
collective.
"""

import pytest
import torch
import torch.nn as nn

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from unit.common import DistributedTest

HIDDEN = 8
STEPS = 3


class EmptyHeadModel(nn.Module):
    """A ``Linear(h, 0)`` head (zero labels) whose output is part of the loss."""

    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.a = nn.Linear(hidden, hidden)
        self.empty = nn.Linear(hidden, 0, bias=False)

    def forward(self, x):
        return self.a(x).square().mean() + self.empty(x).sum()


class SizedAndEmpty(nn.Module):
    """One module holding a sized and a zero-element parameter."""

    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden, hidden) / hidden)
        self.empty = nn.Parameter(torch.empty(0, hidden))

    def forward(self, x):
        return x @ self.weight + (x @ self.empty.t()).sum()


class MixedModuleModel(nn.Module):

    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.mixed = SizedAndEmpty(hidden)

    def forward(self, x):
        return self.mixed(x).square().mean()


class AllEmpty(nn.Module):
    """A submodule whose parameters all have zero elements."""

    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(0, hidden))
        self.bias = nn.Parameter(torch.zeros(0))

    def forward(self, x):
        return (x @ self.weight.t() + self.bias).sum()


class EmptySubmoduleModel(nn.Module):
    """An all-empty submodule next to a sized layer."""

    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.empty = AllEmpty(hidden)

    def forward(self, x):
        return self.linear(x).square().mean() + self.empty(x)


class QuantPlaceholderLinear(nn.Module):
    """A quantized linear before its weights are loaded: 1-D ``torch.zeros(0)`` placeholders."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(0))
        self.qweight = nn.Parameter(torch.zeros(0))
        self.scales = nn.Parameter(torch.zeros(0))

    def forward(self, x):
        return x + self.weight.sum() + self.qweight.sum() * self.scales.sum()


class QuantPlaceholderModel(nn.Module):

    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.quant = QuantPlaceholderLinear()

    def forward(self, x):
        return self.quant(self.linear(x)).square().mean()


MODELS = {
    "empty_head": EmptyHeadModel,
    "sized_and_empty": MixedModuleModel,
    "empty_submodule": EmptySubmoduleModel,
    "quant_placeholders": QuantPlaceholderModel,
}


def zero_config(stage, dtype):
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-2,
                "torch_adam": True,
                # Plain Adam, as the reference: DeepSpeed's "Adam" is AdamW unless told otherwise.
                "adam_w_mode": False,
                "weight_decay": 0.0
            }
        },
        "zero_optimization": {
            "stage": stage
        },
    }
    if dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    return config


def reference_losses(model_cls, dtype):
    """Losses of the same model trained with plain torch Adam on the same data."""
    torch.manual_seed(42)
    model = model_cls()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for x in batches():
        loss = model(x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def batches():
    # Every rank sees the same data, so the data-parallel average gradient equals the
    # single-process one and the losses can be compared with a plain PyTorch run.
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(2, HIDDEN, generator=generator) for _ in range(STEPS)]


def train_and_check(model_name, stage, dtype):
    model_cls = MODELS[model_name]
    torch.manual_seed(42)
    model = model_cls()
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           model_parameters=model.parameters(),
                                           config=zero_config(stage, dtype))
    losses = []
    for x in batches():
        loss = engine(x.to(engine.device, dtype))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())

    assert all(torch.isfinite(torch.tensor(losses))), losses
    if dtype == torch.float32:
        assert losses == pytest.approx(reference_losses(model_cls, dtype), rel=1e-5, abs=1e-6)

    # Every parameter, empty ones included, keeps its declared shape.
    for name, param in engine.module.named_parameters():
        if stage == 3:
            assert tuple(param.ds_shape) == shapes[name], name
            with deepspeed.zero.GatheredParameters([param]):
                assert tuple(param.shape) == shapes[name], name
            # Zero-element parameters are never partitioned, so never released either.
            expected = ZeroParamStatus.AVAILABLE if param.ds_numel == 0 else ZeroParamStatus.NOT_AVAILABLE
            assert param.ds_status == expected, param.ds_summary()
        else:
            assert tuple(param.shape) == shapes[name], name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("model_name", list(MODELS))
class TestZeroEmptyParams(DistributedTest):
    world_size = [1, 2]
    reuse_dist_env = True

    def test(self, model_name, stage, dtype):
        if dtype == torch.bfloat16 and not get_accelerator().is_bf16_supported():
            pytest.skip("bf16 is not supported on this accelerator")
        train_and_check(model_name, stage, dtype)


class EmptySubmodulesModel(nn.Module):
    """Two sized layers, then ``num_empty`` zero-element ``Linear(h, 0)`` submodules (adapters at rank 0)."""

    def __init__(self, num_empty, hidden=HIDDEN):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(hidden, hidden) for _ in range(2)])
        self.empties = nn.ModuleList([nn.Linear(hidden, 0, bias=False) for _ in range(num_empty)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        for empty in self.empties:
            x = x + empty(x).sum()
        return x.square().mean()


def collectives_per_step(num_empty):
    """Collectives issued by one training step (after a warm-up step), by operation name."""
    torch.manual_seed(42)
    model = EmptySubmodulesModel(num_empty)
    config = zero_config(3, torch.float32)
    config["comms_logger"] = {"enabled": True, "prof_all": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = batches()[0].to(engine.device)
    for step in range(2):
        if step == 1:
            dist.reset_log()
        loss = engine(x)
        engine.backward(loss)
        engine.step()
    counts = {
        name: sum(entry[0] for entry in by_size.values())
        for name, by_size in dist.comms_logger.comms_dict.items()
    }
    dist.configure(enabled=False)
    dist.reset_log()
    return counts


class TestZeroEmptyParamsCostNoCollectives(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test(self):
        without = collectives_per_step(num_empty=0)
        with_empty = collectives_per_step(num_empty=4)
        assert without.get("all_gather_into_tensor", 0) > 0, without
        assert with_empty == without
