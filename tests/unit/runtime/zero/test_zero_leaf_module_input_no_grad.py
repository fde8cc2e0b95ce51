# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 leaf modules whose inputs do not require grad.

With ``stage3_module_granularity_threshold`` (or ``set_z3_leaf_modules``), ZeRO-3 reduces a leaf
module's gradients from the module's full backward hook. When no input of the module requires
grad (a leaf fed the input batch, such as a small model whose root becomes the leaf), torch runs
that hook before the parameters' gradients exist; on deepspeed 0.19.8 the first backward then
failed with ``RuntimeError: output with shape [1] doesn't match the broadcast shape [8, 8]``; in
bf16 the released leaf parameters also changed dtype, which hid them from autograd's bookkeeping.
Training with the option must give the losses of training without it.
"""

import pytest
import torch
import torch.nn as nn

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import set_z3_leaf_modules

from unit.common import DistributedTest

HIDDEN = 8
STEPS = 3


class TwoLayers(nn.Module):

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(HIDDEN, HIDDEN)
        self.b = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class BlockThenHead(nn.Module):
    """A leaf block fed the raw input, then a head that stays a regular module."""

    def __init__(self):
        super().__init__()
        self.block = TwoLayers()
        self.head = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return self.head(self.block(x)).square().mean()


class Root(TwoLayers):

    def forward(self, x):
        return super().forward(x).square().mean()


def train(model_cls, leaf, dtype):
    torch.manual_seed(0)
    model = model_cls()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-2,
                "torch_adam": True
            }
        },
        "zero_optimization": {
            "stage": 3
        },
    }
    if dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    if leaf == "granularity_threshold":
        # Small models: the threshold makes the root (Root) or the block (BlockThenHead) the leaf.
        config["zero_optimization"]["stage3_module_granularity_threshold"] = 100
    elif leaf == "set_z3_leaf_modules":
        set_z3_leaf_modules(model, [TwoLayers])
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    # Different data on each rank, so the gradients must really be reduced across ranks.
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    losses = []
    for _ in range(STEPS):
        loss = engine(torch.randn(2, HIDDEN, generator=generator).to(engine.device, dtype))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_cls,leaf", [(Root, "granularity_threshold"), (BlockThenHead, "granularity_threshold"),
                                            (BlockThenHead, "set_z3_leaf_modules")],
                         ids=["root-threshold", "block-threshold", "block-set_z3_leaf_modules"])
class TestZeroLeafModuleInputNoGrad(DistributedTest):
    world_size = [1, 2]
    reuse_dist_env = True

    def test(self, model_cls, leaf, dtype):
        if dtype == torch.bfloat16 and not get_accelerator().is_bf16_supported():
            pytest.skip("bf16 is not supported on this accelerator")
        assert train(model_cls, leaf, dtype) == pytest.approx(train(model_cls, None, dtype), rel=1e-6, abs=1e-7)
