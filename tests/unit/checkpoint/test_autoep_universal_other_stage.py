# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A universal checkpoint of an AutoEP model loads at another ZeRO stage than the one it was
converted from: ZeRO-3 -> ZeRO-2 and ZeRO-2 -> ZeRO-3, at expert-parallel size 2 on two ranks.
Right after the load every parameter's weights, fp32 weights and Adam moments are the saved ones,
and the next loss is that of the run that went on uninterrupted. A load of the checkpoint itself at
the other stage, which cannot move MoE layers' states from the rank files, is refused on every rank
before anything changes, naming both stages and ``ds_to_universal``.

Converted from ZeRO-3 at expert-parallel size 2, it loads exactly at ZeRO-2 and expert-parallel
size 1 too; there the save and the load run in two jobs, as they do in practice: a process keeps
the expert-parallel groups of every engine it creates, and the universal loader takes the largest.

The model states files of the checkpoint keep the names of the stage that saved it (ZeRO-3 names
them after each data-parallel rank). Before, the load of an MoE model looked for its own stage's
names only, and raised a bare AssertionError, finding none, for both loads.
"""

import os

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.runtime.zero.utils import ZeRORuntimeException

from unit.checkpoint.autotp_common import convert_to_universal_checkpoint
from unit.checkpoint.test_ds_to_universal_moe_expert_parallel import assert_states_equal, states_by_global_name
from unit.checkpoint.test_pipeline_moe_other_topology import TAG, batch, make_engine
from unit.checkpoint.test_pipeline_tied_universal import param_states
from unit.common import DistributedTest


@pytest.fixture(scope="module")
def save_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("autoep_other_stage_and_size"))


def step(engine, seed):
    loss = engine(*batch(seed))
    engine.backward(loss)
    engine.step()
    return loss.detach()


class TestAutoEPUniversalOtherStage(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("saved_stage, stage", [(3, 2), (2, 3)])
    def test_loads_at_other_stage(self, saved_stage, stage, tmpdir):
        save_dir = str(tmpdir)
        engine = make_engine("autoep", 2, saved_stage)
        step(engine, seed=0)
        engine.save_checkpoint(save_dir, tag=TAG)
        saved = param_states(engine)
        next_loss = step(engine, seed=1)
        if dist.get_rank() == 0:
            convert_to_universal_checkpoint(os.path.join(save_dir, TAG),
                                            os.path.join(save_dir, "universal"),
                                            inject_missing_state=True)
        dist.barrier()

        # Straight from the rank files it is refused on every rank, naming both stages, before anything changes.
        fresh = make_engine("autoep", 2, stage)
        step(fresh, seed=2)
        before = param_states(fresh)
        with pytest.raises(ZeRORuntimeException, match=f"saved at .*, at ZeRO stage {stage}: .* ds_to_universal"):
            fresh.load_checkpoint(save_dir, tag=TAG)
        for name, tensors in param_states(fresh).items():
            assert all(torch.equal(a, b) for a, b in zip(tensors, before[name])), name

        loaded = make_engine("autoep", 2, stage, load_universal=True)
        loaded.load_checkpoint(save_dir, tag="universal")
        for name, tensors in param_states(loaded).items():
            for kind, tensor, saved_tensor in zip(("weight", "fp32", "exp_avg", "exp_avg_sq"), tensors, saved[name]):
                assert torch.equal(tensor, saved_tensor), f"{name} {kind}"
        assert torch.allclose(step(loaded, seed=1), next_loss, rtol=1e-6, atol=0)


class TestAutoEPUniversalOtherStageAndSize(DistributedTest):
    world_size = 2

    def test_save_at_zero3_ep2(self, save_dir):
        engine = make_engine("autoep", 2, 3)
        step(engine, seed=0)
        engine.save_checkpoint(save_dir, tag=TAG)
        saved = states_by_global_name(engine)
        next_losses = [None] * dist.get_world_size()
        dist.all_gather_object(next_losses, [step(engine, seed) for seed in (1, 2)])
        if dist.get_rank() == 0:
            torch.save((saved, next_losses), os.path.join(save_dir, "expected.pt"))
            convert_to_universal_checkpoint(os.path.join(save_dir, TAG),
                                            os.path.join(save_dir, "universal"),
                                            inject_missing_state=True)
        dist.barrier()

    def test_load_at_zero2_ep1(self, save_dir):
        saved, next_losses = torch.load(os.path.join(save_dir, "expected.pt"))
        loaded = make_engine("autoep", 1, 2, load_universal=True)
        loaded.load_checkpoint(save_dir, tag="universal")
        assert_states_equal(states_by_global_name(loaded), saved)
        losses = torch.stack([step(loaded, seed) for seed in (1, 2)])
        assert torch.allclose(losses, torch.stack(next_losses[dist.get_rank()]), rtol=1e-5, atol=0)
