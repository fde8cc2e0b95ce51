# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``engine.load_checkpoint()`` of a ZeRO-1, -2 or -3 checkpoint saved at another data-parallel size
loads it as it is, with its optimizer states: no ``ds_to_universal``, no config change. Right after
the load the weights are those ``zero_to_fp32`` reads from the checkpoint, the fp32 master weights,
Adam's moments and step counts are the saved ones, the LR scheduler and client state are restored,
each of the optimizer's two parameter groups (the Hugging Face Trainer's: weight decay on matrices,
none on norm weights) keeps its own hyperparameters, and the next steps' losses are those of the
run that saved the checkpoint and went on training uninterrupted on the same global batches (a
resume, not a restart). Covered: data-parallel sizes 2 -> 1 and 1 -> 2 at every stage, 2 -> 1 with
the BF16 optimizer (bf16 ZeRO-1), and AutoTP checkpoints (tp2, dp1 -> dp2) at ZeRO-2 and -3, each
model with a zero-element parameter.

What cannot be resharded is refused before anything is loaded: a checkpoint of another
tensor-parallel size, and one whose optimizer files lack the fragment metadata.

The saving and the loading run at different world sizes, so each source checkpoint is saved by a
test of its own (``TestSave``) into a cache shared by the session; a load test selected without
its source test (``-k``, another order) runs that source test first in a pytest subprocess.

On deepspeed 0.19.8 every such load raises "Automatic adjustment of ZeRO's optimizer state
partitioning with a new world size is not currently supported".
"""

import glob
import json
import os
import shutil

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, PARAM_SLICE_MAPPINGS
from deepspeed.runtime.zero.utils import ZeRORuntimeException
from deepspeed.utils import groups, safe_get_full_fp32_param, safe_get_full_optimizer_state
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from unit.common import DistributedTest
from unit.checkpoint.autotp_common import (build_model, ds_config, param_group_hyperparameters, run_source_test,
                                           train_engine, trainer_param_groups)

SAVE_STEPS = 2
RESUME_STEPS = 2
TAG = "step2"
CLIENT_STATE = {"epoch": 3}
CACHE_ENV = "DS_TEST_ZERO_OTHER_DP_CACHE"
MOMENTS = ("exp_avg", "exp_avg_sq")
PLACEHOLDER = "model.norm.weight_scale"

# Each source checkpoint: stage, tp, dp, dtype. At bf16 with fp32 gradient accumulation ZeRO-1 runs
# the BF16 optimizer.
SOURCES = {f"stage{stage}-tp1dp{dp}": (stage, 1, dp, torch.float32) for stage in (1, 2, 3) for dp in (1, 2)}
SOURCES.update({f"stage{stage}-tp2dp1": (stage, 2, 1, torch.float32) for stage in (2, 3)})
SOURCES["stage1-tp1dp2-bf16"] = (1, 1, 2, torch.bfloat16)
SOURCES_WS1 = [name for name, (_, tp, dp, _) in SOURCES.items() if tp * dp == 1]
SOURCES_WS2 = [name for name, (_, tp, dp, _) in SOURCES.items() if tp * dp == 2]


def initialize(stage, tp_size, dtype=torch.float32):
    groups._release_process_group_references(None)
    config = ds_config(stage, tp_size, dtype=dtype)
    if dtype == torch.bfloat16:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    # A schedule that is still warming up: a scheduler not restored changes the next steps' losses.
    # Its peak learning rate is the group's own.
    config["scheduler"] = {
        "type": "WarmupLR",
        "params": {
            "warmup_num_steps": 10,
            "warmup_type": "linear",
            "warmup_max_lr": [1e-3, 5e-4]
        }
    }
    model = build_model(dtype=dtype)
    # A zero-element parameter, as quantization libraries register for placeholders.
    model.model.norm.register_parameter(PLACEHOLDER.split(".")[-1], torch.nn.Parameter(torch.zeros(0, dtype=dtype)))
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=trainer_param_groups(model))
    return engine


def optimizer_states(engine):
    """Every parameter's fp32 weights and Adam moments, gathered across the data-parallel ranks
    (this rank's tensor-parallel shard of them), and the step counts of the optimizer."""
    states = {}
    for name, param in engine.module.named_parameters():
        if getattr(param, "ds_numel", param.numel()) == 0:
            continue  # nothing to optimize, no optimizer state
        states[name] = {"fp32": safe_get_full_fp32_param(param).detach().cpu().clone()}
        for key in MOMENTS:
            states[name][key] = safe_get_full_optimizer_state(param, key).detach().cpu().clone()
    steps = {float(state["step"]) for state in engine.optimizer.optimizer.state.values()}
    return states, steps


def full_weights(engine, stage, tp_size):
    """The module's whole weights (tensor-parallel shards merged) on rank 0, None elsewhere."""
    if stage == 3 or tp_size > 1:
        state_dict = engine._consolidated_16bit_state_dict()
    else:
        state_dict = engine.module.state_dict() if dist.get_rank() == 0 else None
    return None if state_dict is None else {name: value.detach().float().cpu() for name, value in state_dict.items()}


def save(cache, source):
    """Train SAVE_STEPS steps and save; record the gathered optimizer states, then go on training
    uninterrupted for RESUME_STEPS steps and record their losses."""
    stage, tp_size, dp_size, dtype = SOURCES[source]
    assert dist.get_world_size() == tp_size * dp_size
    folder = os.path.join(cache, source)
    engine = initialize(stage, tp_size, dtype)
    train_engine(engine, tp_size, SAVE_STEPS)
    engine.save_checkpoint(folder, tag=TAG, client_state=CLIENT_STATE)
    states, steps = optimizer_states(engine)
    groups_saved = param_group_hyperparameters(engine)
    losses = train_engine(engine, tp_size, RESUME_STEPS, first_step=SAVE_STEPS)
    if dist.get_rank() < tp_size:
        torch.save({
            "states": states,
            "steps": steps,
            "param_groups": groups_saved
        }, os.path.join(folder, f"states_tp{dist.get_rank()}.pt"))
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(folder, "done.json"), "w") as f:
            json.dump({"losses": losses}, f)
    dist.barrier()
    engine.destroy()


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    return os.environ.get(CACHE_ENV) or str(tmp_path_factory.mktemp("zero_other_dp"))


@pytest.fixture
def saved(request, cache):
    """The folder of the test's source checkpoint, saved first in a pytest subprocess if this
    session has not saved it (the load test was selected alone)."""
    source = request.getfixturevalue("source")
    folder = os.path.join(cache, source)
    if not os.path.isfile(os.path.join(folder, "done.json")):
        method = "test_ws1" if source in SOURCES_WS1 else "test_ws2"
        run_source_test(request, f"TestSave::{method}[{source}]", CACHE_ENV, cache, os.path.join(folder, "done.json"))
    return folder


class TestSave(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.world_size(1)
    @pytest.mark.parametrize("source", SOURCES_WS1)
    def test_ws1(self, source, cache):
        save(cache, source)

    @pytest.mark.parametrize("source", SOURCES_WS2)
    def test_ws2(self, source, cache):
        save(cache, source)


def load_and_train(folder, source, dp_size):
    stage, tp_size, saved_dp_size, dtype = SOURCES[source]
    assert dist.get_world_size() == tp_size * dp_size and dp_size != saved_dp_size
    engine = initialize(stage, tp_size, dtype)
    load_path, client_state = engine.load_checkpoint(folder, tag=TAG)
    assert load_path is not None
    assert client_state["epoch"] == CLIENT_STATE["epoch"]
    assert engine.global_steps == SAVE_STEPS
    assert engine.lr_scheduler.last_batch_iteration == SAVE_STEPS - 1

    tp_rank = groups.get_tensor_model_parallel_rank() if tp_size > 1 else 0
    saved = torch.load(os.path.join(folder, f"states_tp{tp_rank}.pt"))
    states, steps = optimizer_states(engine)
    assert steps == saved["steps"] == {float(SAVE_STEPS)}
    # Each group's own: weight decay on the matrices only, each group's learning rate.
    assert param_group_hyperparameters(engine) == saved["param_groups"]
    assert [group["weight_decay"] for group in saved["param_groups"]] == [0.1, 0.0]
    assert saved["param_groups"][0]["lr"] == 2 * saved["param_groups"][1]["lr"] > 0
    assert sorted(states) == sorted(saved["states"])
    for name, param_states in states.items():
        for key, value in param_states.items():
            assert torch.equal(value, saved["states"][name][key]), f"{name} {key}"

    weights = full_weights(engine, stage, tp_size)
    if dist.get_rank() == 0:
        if dtype == torch.float32:
            expected = get_fp32_state_dict_from_zero_checkpoint(folder, tag=TAG)
        else:
            # zero_to_fp32 does not read the BF16 optimizer's checkpoints: the saved fp32 weights.
            expected = {name: param_states["fp32"] for name, param_states in saved["states"].items()}
            expected[PLACEHOLDER] = torch.zeros(0)
        assert sorted(weights) == sorted(expected)
        for name, value in expected.items():
            # The module holds the fp32 master weights rounded to its dtype.
            assert torch.equal(weights[name], value.to(dtype).float()), name
    dist.barrier()

    losses = train_engine(engine, tp_size, RESUME_STEPS, first_step=SAVE_STEPS)
    with open(os.path.join(folder, "done.json")) as f:
        uninterrupted = json.load(f)["losses"]
    # bf16 forwards of other micro-batch sizes round differently.
    assert losses == pytest.approx(uninterrupted, rel=1e-5 if dtype == torch.float32 else 1e-2)
    engine.destroy()


class TestLoad(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.world_size(1)
    @pytest.mark.parametrize("source", ["stage1-tp1dp2", "stage2-tp1dp2", "stage3-tp1dp2", "stage1-tp1dp2-bf16"])
    def test_ws1(self, source, saved):
        load_and_train(saved, source, dp_size=1)

    @pytest.mark.parametrize("source", ["stage1-tp1dp1", "stage2-tp1dp1", "stage3-tp1dp1"])
    def test_ws2(self, source, saved):
        load_and_train(saved, source, dp_size=2)

    @pytest.mark.world_size(4)
    @pytest.mark.parametrize("source", ["stage2-tp2dp1", "stage3-tp2dp1"])
    def test_ws4(self, source, saved):
        load_and_train(saved, source, dp_size=2)


def assert_refused(engine, folder, match):
    """The load raises on every rank before anything is loaded: the weights are those of the
    freshly initialized engine."""
    before = [param.detach().clone() for param in engine.module.parameters()]
    with pytest.raises(ZeRORuntimeException, match=match):
        engine.load_checkpoint(folder, tag=TAG)
    assert all(torch.equal(param, value) for param, value in zip(engine.module.parameters(), before))
    assert engine.global_steps == 0


class TestRefuse(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("source", ["stage2-tp2dp1"])
    def test_other_tp_size(self, source, saved):
        engine = initialize(2, tp_size=1)
        match = r"saved at tensor-parallel size 2, at tensor-parallel size 1\. Nothing was loaded; convert it"
        assert_refused(engine, saved, match + " with ds_to_universal")

    @pytest.mark.world_size(1)
    @pytest.mark.parametrize("source", ["stage1-tp1dp2"])
    def test_no_fragment_metadata(self, source, saved, tmpdir):
        # A checkpoint whose optimizer files do not say where each parameter lies in them.
        folder = str(tmpdir)
        shutil.copytree(os.path.join(saved, TAG), os.path.join(folder, TAG))
        for path in glob.glob(os.path.join(folder, TAG, "*_optim_states.pt")):
            state = torch.load(path, weights_only=False)
            del state[OPTIMIZER_STATE_DICT][PARAM_SLICE_MAPPINGS]
            torch.save(state, path)
        engine = initialize(1, tp_size=1)
        match = f"lacks the metadata to reshard .*records no {PARAM_SLICE_MAPPINGS}.*"
        assert_refused(engine, folder, match + "load it at data-parallel size 2")
