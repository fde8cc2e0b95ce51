# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``ds_to_universal`` converts the checkpoint of a ``PipelineModule`` with fewer layer files between
its first and its last than stages: four layers at pipeline-parallel size 2, the first tied to the
last (``TiedLayerSpec``), which the pipeline saves in three layer files. The universal checkpoint
then loads at pipeline-parallel size 2 with every parameter's weights, fp32 weights and Adam
moments those of the first stage that held it.

``DeepSpeedCheckpoint`` maps the layer files between the first and the last to the stages, as a
Megatron model's transformer layers, when it opens the checkpoint. One such file over two stages
gave zero layers per stage, and on deepspeed 0.19.8 the conversion failed with
"ZeroDivisionError: integer division or modulo by zero".
"""

import os

import torch

import deepspeed.comm as dist

from unit.checkpoint.autotp_common import convert_to_universal_checkpoint
from unit.checkpoint.test_pipeline_tied_universal import (TAG, batch, first_stage_states, param_states,
                                                          tied_pipeline_engine)
from unit.common import DistributedTest


class TestPipelineFewLayersUniversal(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test_converts_and_loads(self, tmpdir):
        save_dir = str(tmpdir)
        engine = tied_pipeline_engine(2, hidden_layers=2)
        engine.train_batch(iter([batch(0)]))
        engine.save_checkpoint(save_dir, tag=TAG)
        saved = first_stage_states(engine)
        if dist.get_rank() == 0:
            convert_to_universal_checkpoint(os.path.join(save_dir, TAG), os.path.join(save_dir, "universal"))
        dist.barrier()

        loaded = tied_pipeline_engine(2, load_universal=True, hidden_layers=2)
        loaded.load_checkpoint(save_dir, tag="universal")
        for name, tensors in param_states(loaded).items():
            for kind, tensor, saved_tensor in zip(("weight", "fp32", "exp_avg", "exp_avg_sq"), tensors, saved[name]):
                assert torch.equal(tensor, saved_tensor), f"{name} {kind}"
