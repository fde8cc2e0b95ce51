# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""zero_to_fp32 consolidation of checkpoints whose model has zero-element parameters.

The consolidated state dict must have the keys and shapes of the model's own ``state_dict()``:
ZeRO-1 consolidation used to drop zero-element parameters, and ZeRO-2 consolidation returned
them as aliases of each other (a ``(0,)`` placeholder came back as ``(0, 8)``).
"""

import pytest
import torch
import torch.nn as nn

import deepspeed
import deepspeed.comm as dist
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from unit.common import DistributedTest

HIDDEN = 8


class EmptyParamsModel(nn.Module):
    """Every zero-element shape at once: an empty head, a sized and an empty parameter on one
    module, an all-empty submodule, and 1-D placeholders named like a quantized linear's."""

    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, 0, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.empty = nn.Parameter(torch.empty(0, hidden))
        self.adapter = nn.Linear(hidden, 0)
        self.quant = nn.ParameterDict({name: nn.Parameter(torch.zeros(0)) for name in ("weight", "qweight", "scales")})

    def forward(self, x):
        h = self.linear(x) * self.scale
        empties = self.head(h).sum() + (h @ self.empty.t()).sum() + self.adapter(h).sum()
        empties = empties + sum(p.sum() for p in self.quant.values())
        return h.square().mean() + empties


def config(stage):
    return {
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
            "stage": stage
        },
    }


@pytest.mark.parametrize("stage", [1, 2, 3])
class TestZeroToFp32EmptyParams(DistributedTest):
    world_size = [1, 2]
    reuse_dist_env = True

    def test(self, stage, tmpdir):
        torch.manual_seed(0)
        model = EmptyParamsModel()
        expected_shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(stage))
        generator = torch.Generator().manual_seed(1)
        for _ in range(2):
            loss = engine(torch.randn(2, HIDDEN, generator=generator).to(engine.device))
            engine.backward(loss)
            engine.step()
        trained = {}
        for name, param in engine.module.named_parameters():
            with deepspeed.zero.GatheredParameters([param]):
                trained[name] = param.detach().float().cpu().clone()
        save_dir = str(tmpdir.join("checkpoint"))
        engine.save_checkpoint(save_dir, tag="step2")
        dist.barrier()

        if dist.get_rank() == 0:
            state_dict = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="step2")
            assert {name: tuple(t.shape) for name, t in state_dict.items()} == expected_shapes
            for name, value in trained.items():
                assert torch.equal(state_dict[name], value), name
            # and it loads into a fresh model as it is
            EmptyParamsModel().load_state_dict(state_dict, strict=True)
        dist.barrier()
