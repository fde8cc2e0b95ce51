# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``ds_to_universal`` converts the checkpoint of a ``PipelineModule`` with fewer layer files than
two per stage: four layers at pipeline-parallel size 2, the first tied to the last
(``TiedLayerSpec``), which the pipeline saves in three layer files. Every parameter's fp32 weights
in the universal checkpoint are those the stage that holds it saved.

``DeepSpeedCheckpoint`` maps the layer files between the first and the last to the stages, as a
Megatron model's transformer layers, when it opens the checkpoint. One such file over two stages
gave zero layers per stage, and on deepspeed 0.19.8 the conversion failed with
"ZeroDivisionError: integer division or modulo by zero".
"""

import argparse
import os

import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.utils import safe_get_full_fp32_param

from unit.common import DistributedTest

HIDDEN = 16


def convert(input_folder, output_folder):
    from deepspeed.checkpoint.ds_to_universal import main
    main(
        argparse.Namespace(input_folder=input_folder,
                           output_folder=output_folder,
                           num_extract_workers=1,
                           num_merge_workers=1,
                           keep_temp_folder=False,
                           strict=True,
                           inject_missing_state=True))


class TestPipelineFewLayersUniversal(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test_converts(self, tmpdir):
        torch.manual_seed(0)
        layers = [TiedLayerSpec("embed", torch.nn.Linear, HIDDEN, HIDDEN)]
        layers += [LayerSpec(torch.nn.Linear, HIDDEN, HIDDEN) for _ in range(2)]
        layers += [
            TiedLayerSpec("embed", torch.nn.Linear, HIDDEN, HIDDEN, forward_fn=lambda embed, x: x @ embed.weight)
        ]
        model = PipelineModule(layers=layers, num_stages=2, loss_fn=torch.nn.MSELoss())
        config = {
            "train_micro_batch_size_per_gpu": 2,
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
        generator = torch.Generator().manual_seed(0)
        engine.train_batch(
            iter([(torch.randn(2, HIDDEN, generator=generator), torch.randn(2, HIDDEN, generator=generator))]))
        save_dir = str(tmpdir)
        engine.save_checkpoint(save_dir, tag="step1")
        saved = {name: safe_get_full_fp32_param(param) for name, param in engine.module.named_parameters()}
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, saved)

        if dist.get_rank() == 0:
            convert(os.path.join(save_dir, "step1"), os.path.join(save_dir, "universal"))
            for stage, stage_saved in enumerate(found):
                for name, fp32 in stage_saved.items():
                    converted = torch.load(os.path.join(save_dir, "universal", "zero", name, "fp32.pt"))["param"]
                    # The tied module's other copy is the last stage's: it converts one of them.
                    if not name.startswith("tied_modules."):
                        assert torch.equal(converted, fp32), f"{name} of stage {stage}"
                    assert converted.shape == fp32.shape, name
        dist.barrier()
