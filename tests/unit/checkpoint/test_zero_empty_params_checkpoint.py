# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Every checkpoint format round-trips zero-element parameters with the keys and shapes of the
model's own ``state_dict()``: ``save_checkpoint``/``load_checkpoint``, ``save_16bit_model``,
``zero_to_fp32`` (API and the script saved into the checkpoint), and universal conversion
(``ds_to_universal``) and restore.

On deepspeed 0.19.8 ZeRO-3 stops at the fetch assert before anything is saved; ZeRO-1
consolidation dropped zero-element parameters and ZeRO-2 consolidation returned them with the
shape of another one (a ``(0,)`` placeholder came back as ``(0, 8)``); the ZeRO-3 universal
checkpoint had no entry for them.
"""

import argparse
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.checkpoint.ds_to_universal import main as convert_to_universal
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


def config(stage, dtype, load_universal=False):
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
            "stage": stage,
            "stage3_gather_16bit_weights_on_model_save": True
        },
        "checkpoint": {
            "load_universal": load_universal
        },
    }
    if dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    return config


def make_engine(stage, dtype, load_universal=False):
    torch.manual_seed(0)
    model = EmptyParamsModel()
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           model_parameters=model.parameters(),
                                           config=config(stage, dtype, load_universal))
    return engine


def train_step(engine, generator):
    loss = engine(torch.randn(2, HIDDEN, generator=generator).to(engine.device, engine.module.linear.weight.dtype))
    engine.backward(loss)
    engine.step()
    return loss.item()


def gathered_params(engine):
    params = {}
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            params[name] = param.detach().cpu().clone()
    return params


def shapes(state_dict):
    return {name: tuple(t.shape) for name, t in state_dict.items()}


def assert_same_tensors(actual, expected):
    assert shapes(actual) == shapes(expected)
    for name, value in expected.items():
        assert torch.equal(actual[name].to(value.dtype), value), name


def assert_resumes(engine, trained, next_loss, stage, dtype, checkpoint_dir, tag, load_universal=False):
    """A fresh engine loaded from the checkpoint holds the trained parameters and takes the same next step."""
    restored = make_engine(stage, dtype, load_universal)
    restored.load_checkpoint(checkpoint_dir, tag=tag)
    assert_same_tensors(gathered_params(restored), trained)
    # The optimizer state came back too: the next step's loss is the original engine's.
    assert train_step(restored, torch.Generator().manual_seed(2)) == pytest.approx(next_loss, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
class TestZeroEmptyParamsCheckpoint(DistributedTest):
    world_size = [1, 2]
    reuse_dist_env = True

    def test(self, stage, dtype, tmpdir):
        if dtype == torch.bfloat16 and not get_accelerator().is_bf16_supported():
            pytest.skip("bf16 is not supported on this accelerator")
        expected_shapes = shapes(EmptyParamsModel().state_dict())
        engine = make_engine(stage, dtype)
        generator = torch.Generator().manual_seed(1)
        for _ in range(2):
            train_step(engine, generator)
        trained = gathered_params(engine)
        save_dir = str(tmpdir.join("checkpoint"))
        engine.save_checkpoint(save_dir, tag="step2")
        assert engine.save_16bit_model(save_dir, "model_16bit.bin")
        dist.barrier()
        next_loss = train_step(engine, torch.Generator().manual_seed(2))

        # save_checkpoint / load_checkpoint
        assert_resumes(engine, trained, next_loss, stage, dtype, save_dir, "step2")

        if dist.get_rank() == 0:
            # save_16bit_model: the model's keys and shapes, the trained values.
            assert_same_tensors(torch.load(os.path.join(save_dir, "model_16bit.bin"), map_location="cpu"), trained)

            # zero_to_fp32, API: the fp32 master weights, which round to the trained parameters.
            state_dict = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="step2")
            assert shapes(state_dict) == expected_shapes
            assert_same_tensors(state_dict, trained)
            EmptyParamsModel().load_state_dict(state_dict, strict=True)

            # zero_to_fp32, the script saved into the checkpoint, run as users run it.
            output_dir = os.path.join(save_dir, "fp32")
            subprocess.run(
                [sys.executable, os.path.join(save_dir, "zero_to_fp32.py"), save_dir, output_dir], check=True)
            script_state_dict = torch.load(os.path.join(output_dir, "pytorch_model.bin"))
            assert_same_tensors(script_state_dict, state_dict)

            # Universal conversion: every parameter of the model, empty ones in their own shape.
            convert_to_universal(
                argparse.Namespace(
                    input_folder=os.path.join(save_dir, "step2"),
                    output_folder=os.path.join(save_dir, "step2_universal"),
                    num_extract_workers=1,
                    num_merge_workers=1,
                    keep_temp_folder=False,
                    strict=True,
                    # A plain ZeRO-1/2 checkpoint records no universal checkpoint info.
                    inject_missing_state=stage < 3))
            for name, shape in expected_shapes.items():
                universal = torch.load(os.path.join(save_dir, "step2_universal", "zero", name, "fp32.pt"),
                                       weights_only=False)
                # 0.19.8's ZeRO-3 conversion wrote sized parameters flattened, as a bare tensor.
                universal = universal["param"] if isinstance(universal, dict) else universal
                assert universal.numel() == state_dict[name].numel(), name
                assert torch.equal(universal.view(shape), state_dict[name]), name
        dist.barrier()

        # Universal restore
        assert_resumes(engine, trained, next_loss, stage, dtype, save_dir, "step2_universal", load_universal=True)
