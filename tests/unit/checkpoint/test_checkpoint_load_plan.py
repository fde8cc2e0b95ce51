# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The plan of a checkpoint load is made from the engine's view alone, before anything is loaded.

``LoadPlan`` (``deepspeed/runtime/checkpoint_engine/load_plan.py``) reads what a checkpoint tag
holds and decides how ``load_checkpoint()`` loads it: the ZeRO stage that saved it, whether the
optimizer states are resharded, and the reader they are loaded through. Here a job resumes a ZeRO-2
checkpoint at ZeRO-3: its plan names the saved stage, reshards, and reads the saved fp32 weights
from the rank files, while the engine keeps its own weights until the load.
"""

import torch

from deepspeed.checkpoint.utils import load_checkpoint_file
from deepspeed.runtime.checkpoint_engine.load_plan import LoadPlan
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils import safe_get_full_fp32_param

from unit.checkpoint.autotp_common import train_engine
from unit.checkpoint.zero_load_common import initialize
from unit.common import DistributedTest


def fp32_weights(engine):
    return {
        name: safe_get_full_fp32_param(param).cpu().clone()
        for name, param in engine.module.named_parameters() if getattr(param, "ds_numel", param.numel())
    }


class TestLoadPlan(DistributedTest):
    world_size = 1

    def test_zero2_checkpoint_into_zero3_is_planned_before_anything_is_loaded(self, tmpdir):
        save_dir, tag = str(tmpdir), "step1"
        saver = initialize(2, tp_size=1)
        train_engine(saver, tp_size=1, steps=1)
        saver.save_checkpoint(save_dir, tag=tag)
        saved = fp32_weights(saver)

        engine = initialize(3, tp_size=1)
        initial = fp32_weights(engine)
        ckpt_list = engine._get_all_ckpt_names(save_dir, tag)
        plan = LoadPlan(engine._checkpoint_view(), save_dir, tag, ckpt_list, optimizer_states=True)
        plan.check_model_states_files(engine._get_ckpt_name(save_dir, tag))
        assert plan.model_states_rank() == (1, 0)
        reader = plan.decide(load_checkpoint_file(ckpt_list[0]))

        assert plan.saved_stage == ZeroStageEnum.gradients and plan.other_stage and plan.reshard
        assert reader is plan.reader and reader.optimizer_stepped
        for name, weight in saved.items():
            assert torch.equal(reader.read(name, "fp32", 0, weight.numel()), weight.flatten()), name
        after = fp32_weights(engine)
        assert all(torch.equal(after[name], initial[name]) for name in initial)

        engine.load_checkpoint(save_dir, tag=tag)
        loaded = fp32_weights(engine)
        assert all(torch.equal(loaded[name], saved[name]) for name in saved)
