# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``zero_to_fp32`` consolidates AutoTP checkpoints: the API and the script saved into the
checkpoint return one full fp32 state dict with the keys and shapes of the model's own
``state_dict()``, holding what a single process trained on the same data holds, at ZeRO stages 1-3,
at tp2 and tp2 x dp2, with even and uneven tensor-parallel splits. A checkpoint with a missing or
an extra rank file, and a fused QKV layout that cannot be reassembled, are refused with an error
that names the cause.

On deepspeed 0.19.8 every tp2 case fails with ``ValueError: Expected 1 of '*_optim_states.pt' ...
but found 2 files. Possibly due to an overwrite of an old checkpoint``: it read the first
tensor-parallel rank only. The tp1 cases are the baseline, which 0.19.8 passes too.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from unit.common import DistributedTest
from unit.checkpoint.autotp_common import (build_model, ds_config, forget_saved_files, initialize, train_engine,
                                           train_reference)

STEPS = 2
TAG = "step2"
# The topologies sum the gradients in a different order than the reference; Adam turns those
# roundings into differences of a few 1e-4 after two steps of 1e-2. A shard in the wrong place
# or a missing one is off by the size of the weights (~1e-1).
ATOL = 2e-3


def shapes(state_dict):
    return {name: tuple(tensor.shape) for name, tensor in state_dict.items()}


def assert_matches_reference(state_dict, reference):
    assert shapes(state_dict) == shapes(reference)
    for name, expected in reference.items():
        assert state_dict[name].dtype == torch.float32, name
        torch.testing.assert_close(state_dict[name], expected, rtol=0, atol=ATOL, msg=name)


def initialize_without_tensor_parallelism(stage, uneven):
    model = build_model(uneven)
    config = ds_config(stage, 1)
    del config["tensor_parallel"]
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    return engine


def save_trained_checkpoint(tmpdir, stage, tp_size, uneven):
    if tp_size == 1:
        engine = initialize_without_tensor_parallelism(stage, uneven)
    else:
        engine = initialize(stage, tp_size, uneven=uneven)
    train_engine(engine, tp_size, STEPS, uneven=uneven)
    save_dir = str(tmpdir.join("checkpoint"))
    engine.save_checkpoint(save_dir, tag=TAG)
    dist.barrier()
    return engine, save_dir


def run_saved_script(save_dir, output_dir):
    """The zero_to_fp32.py saved into the checkpoint, run as users run it."""
    result = subprocess.run(
        [sys.executable, os.path.join(save_dir, "zero_to_fp32.py"), save_dir, output_dir],
        capture_output=True,
        text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def copy_checkpoint(save_dir, name):
    copy = os.path.join(os.path.dirname(save_dir), name)
    shutil.copytree(save_dir, copy)
    return copy, os.path.join(copy, TAG)


def assert_refuses_incomplete_checkpoints(save_dir, stage):
    """A missing rank file, and one left from a checkpoint with more ranks, are named in the error."""
    missing_optim = "zero_pp_rank_1_mp_rank_01_optim_states.pt"
    copy, tag_dir = copy_checkpoint(save_dir, "missing_optim")
    os.remove(os.path.join(tag_dir, missing_optim))
    with pytest.raises(ValueError, match=re.escape(f"{missing_optim} (missing)")):
        get_fp32_state_dict_from_zero_checkpoint(copy, tag=TAG)

    missing_model = "zero_pp_rank_1_mp_rank_01_model_states.pt" if stage == 3 else "mp_rank_01_model_states.pt"
    copy, tag_dir = copy_checkpoint(save_dir, "missing_model")
    os.remove(os.path.join(tag_dir, missing_model))
    with pytest.raises(ValueError, match=re.escape(f"{missing_model} (missing)")):
        get_fp32_state_dict_from_zero_checkpoint(copy, tag=TAG)

    extra = "zero_pp_rank_2_mp_rank_01_optim_states.pt"
    copy, tag_dir = copy_checkpoint(save_dir, "extra_optim")
    shutil.copy(os.path.join(tag_dir, "zero_pp_rank_1_mp_rank_01_optim_states.pt"), os.path.join(tag_dir, extra))
    with pytest.raises(ValueError, match=re.escape(f"{extra} (unexpected")):
        get_fp32_state_dict_from_zero_checkpoint(copy, tag=TAG)


def assert_refuses_fused_qkv(save_dir):
    """A layout AutoTP records as not reassemblable (a fused QKV weight that interleaves or replicates
    blocks across ranks) is refused by name, as ds_to_universal refuses it, instead of merged wrong."""
    copy, tag_dir = copy_checkpoint(save_dir, "fused_qkv")
    pattern = r"^model\.layers\.0\.self_attn\.q_proj\.weight$"
    reason = "its fused qkv layout interleaves or replicates blocks across tensor parallel ranks"
    for name in os.listdir(tag_dir):
        if name.endswith("_model_states.pt"):
            path = os.path.join(tag_dir, name)
            model_state = torch.load(path, weights_only=False)
            model_state["universal_checkpoint_info"]["autotp_unsupported_parameter_patterns"] = {pattern: reason}
            torch.save(model_state, path)
    forget_saved_files(tag_dir)
    with pytest.raises(ValueError, match="cannot consolidate this AutoTP checkpoint.*q_proj.*fused qkv layout"):
        get_fp32_state_dict_from_zero_checkpoint(copy, tag=TAG)


@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
@pytest.mark.parametrize("stage", [1, 2, 3])
class TestAutoTPZeroToFp32(DistributedTest):
    """tp2 at world size 2, tp2 x dp2 at world size 4."""
    world_size = [2, 4]
    reuse_dist_env = True

    def test(self, stage, uneven, tmpdir):
        engine, save_dir = save_trained_checkpoint(tmpdir, stage, 2, uneven)
        if dist.get_rank() == 0:
            reference = train_reference(STEPS, uneven=uneven)[0].state_dict()

            state_dict = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag=TAG)
            assert_matches_reference(state_dict, reference)
            build_model(uneven).load_state_dict(state_dict, strict=True)

            lazy = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag=TAG, lazy_mode=True)
            assert shapes(lazy) == shapes(reference)
            torch.testing.assert_close(lazy["lm_head.weight"].contiguous(), state_dict["lm_head.weight"])

            # The script (a subprocess: a few seconds each) at tp2 ZeRO-1 and tp2 x dp2 ZeRO-3.
            if uneven and (stage, dist.get_world_size()) in ((1, 2), (3, 4)):
                output_dir = os.path.join(save_dir, "fp32")
                run_saved_script(save_dir, output_dir)
                assert_matches_reference(torch.load(os.path.join(output_dir, "pytorch_model.bin")), reference)
            if uneven and dist.get_world_size() == 4:
                assert_refuses_incomplete_checkpoints(save_dir, stage)
            if uneven and dist.get_world_size() == 2 and stage == 1:
                assert_refuses_fused_qkv(save_dir)
        dist.barrier()
        engine.destroy()


@pytest.mark.parametrize("stage", [1, 2, 3])
class TestZeroToFp32WithoutTensorParallelism(DistributedTest):
    """The baseline: the same model without tensor parallelism, which 0.19.8 consolidates too. (At
    world size 1: a process that ran AutoTP keeps its tensor-parallel groups, so the pools of the
    class above cannot be reused.)"""
    world_size = 1
    reuse_dist_env = True

    def test(self, stage, tmpdir):
        engine, save_dir = save_trained_checkpoint(tmpdir, stage, 1, uneven=True)
        if dist.get_rank() == 0:
            reference = train_reference(STEPS, uneven=True)[0].state_dict()
            assert_matches_reference(get_fp32_state_dict_from_zero_checkpoint(save_dir, tag=TAG), reference)
        dist.barrier()
        engine.destroy()
