# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Shared pieces of the tests that resume a ZeRO checkpoint on another topology: a source checkpoint
is a small Llama trained with the Hugging Face Trainer's two parameter groups and a zero-element
placeholder, saved with what the run that went on uninterrupted did next (its optimizer states,
its groups' hyperparameters, its next losses); a load test resumes it and checks that it continues
that run.

Each test file names its source checkpoints in ``SOURCES`` (name: stage, tp, dp, dtype, optimizer,
and optionally "tied" for a model whose output embeddings are its input embeddings) and saves each
one by a test of its own, ``TestSave::test_ws1`` or ``TestSave::test_ws2`` (by the world size it is
saved at), into a cache shared by the session; a load test selected without its source test (``-k``,
another order) runs that source test first in a pytest subprocess.
"""

import json
import os
import re
import sys

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.checkpoint.affine import ParamAffineMap
from deepspeed.checkpoint.constants import AFFINE_MAP, AFFINE_MAP_PARAMS, UNIVERSAL_CHECKPOINT_INFO
from deepspeed.runtime.zero.utils import ZeRORuntimeException
from deepspeed.utils import groups, safe_get_full_fp32_param, safe_get_full_optimizer_state
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from unit.checkpoint.autotp_common import (LR, build_model, ds_config, param_group_hyperparameters, run_source_test,
                                           train_engine, trainer_param_groups)

SAVE_STEPS = 2
RESUME_STEPS = 2
TAG = "step2"
UNIVERSAL_TAG = "step2_universal"
CLIENT_STATE = {"epoch": 3}
CACHE_ENV = "DS_TEST_ZERO_OTHER_DP_CACHE"
# The states each optimizer keeps per element, by its own names. ASGD also keeps scalars that are
# not a step count ("eta", "mu"), which a load at another data-parallel size does not restore.
OPTIMIZER_STATES = {
    "adam": ("exp_avg", "exp_avg_sq"),
    "cpu_adam": ("exp_avg", "exp_avg_sq"),
    "sgd": ("momentum_buffer", ),
    "plain_sgd": (),
    "adagrad": ("sum", ),
    "asgd": ("ax", )
}
PLACEHOLDER = "model.norm.weight_scale"
# The list that the paths opened by this process are added to, while a load is traced.
_opened = None


def _record_open(event, args):
    if _opened is not None and event == "open" and isinstance(args[0], (str, os.PathLike)):
        _opened.append(os.fspath(args[0]))


sys.addaudithook(_record_open)


def client_optimizer(name, param_groups):
    """``name``'s torch optimizer, as a training script builds it and hands it to deepspeed.initialize."""
    if name == "sgd":
        return torch.optim.SGD(param_groups, lr=LR, momentum=0.9)
    if name == "plain_sgd":
        return torch.optim.SGD(param_groups, lr=LR)
    if name == "adagrad":
        return torch.optim.Adagrad(param_groups, lr=LR)
    return torch.optim.ASGD(param_groups, lr=LR)


def initialize(stage,
               tp_size,
               dtype=torch.float32,
               optimizer="adam",
               load_universal=False,
               uneven=False,
               tied=False,
               frozen=False,
               param_groups=trainer_param_groups):
    groups._release_process_group_references(None)
    config = ds_config(stage, tp_size, dtype=dtype, load_universal=load_universal)
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
    model = build_model(uneven=uneven, dtype=dtype)
    if tied:
        # As Llama checkpoints with tie_word_embeddings load: one parameter for both.
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    if frozen:
        # A frozen layer, as in fine-tuning some layers only.
        model.model.layers[0].mlp.requires_grad_(False)
    # A zero-element parameter, as quantization libraries register for placeholders.
    model.model.norm.register_parameter(PLACEHOLDER.split(".")[-1], torch.nn.Parameter(torch.zeros(0, dtype=dtype)))
    if optimizer == "cpu_adam":
        # DeepSpeed's CPU Adam: what the same config builds with the optimizer offloaded.
        del config["optimizer"]["params"]["torch_adam"]
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if optimizer in ("adam", "cpu_adam"):
        engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=param_groups(model))
    else:
        del config["optimizer"]
        config["zero_allow_untested_optimizer"] = True
        engine, _, _, _ = deepspeed.initialize(model=model,
                                               config=config,
                                               optimizer=client_optimizer(optimizer, param_groups(model)))
    return engine


def optimizer_states(engine, optimizer):
    """Every parameter's fp32 weights and the states ``optimizer`` keeps per element, gathered across
    the data-parallel ranks (this rank's tensor-parallel shard of them), and the optimizer's step
    counts."""
    states = {}
    for name, param in engine.module.named_parameters():
        if getattr(param, "ds_numel", param.numel()) == 0:
            continue  # nothing to optimize, no optimizer state
        states[name] = {"fp32": safe_get_full_fp32_param(param).detach().cpu().clone()}
        for key in OPTIMIZER_STATES[optimizer]:
            states[name][key] = safe_get_full_optimizer_state(param, key).detach().cpu().clone()
    steps = {float(state["step"]) for state in engine.optimizer.optimizer.state.values() if "step" in state}
    return states, steps


def affine_maps(engine):
    """``{name: ParamAffineMap}`` of the parameters that AutoTP lays out over the tensor-parallel ranks."""
    uc_info = getattr(engine.module, UNIVERSAL_CHECKPOINT_INFO)[AFFINE_MAP][AFFINE_MAP_PARAMS]
    return {
        name: ParamAffineMap.from_dict(uc_info[rf"^{re.escape(name)}$"])
        for name, _ in engine.module.named_parameters()
    }


def whole_states(engine, states, tp_size):
    """``states`` of this rank's tensor-parallel shard merged with the other shards' into whole tensors."""
    if tp_size == 1:
        return {
            name: {
                key: value.flatten()
                for key, value in param_states.items()
            }
            for name, param_states in states.items()
        }
    all_states = [None] * dist.get_world_size()
    dist.all_gather_object(all_states, states)
    # AutoTP groups consecutive ranks into one tensor-parallel group.
    maps = affine_maps(engine)
    return {
        name: {
            key: maps[name].rebuild({
                rank: all_states[rank][name][key]
                for rank in range(tp_size)
            }).flatten()
            for key in param_states
        }
        for name, param_states in states.items()
    }


def full_weights(engine, stage, tp_size):
    """The module's whole weights (tensor-parallel shards merged) on rank 0, None elsewhere."""
    if stage == 3 or tp_size > 1:
        state_dict = engine._consolidated_16bit_state_dict()
    else:
        state_dict = engine.module.state_dict() if dist.get_rank() == 0 else None
    return None if state_dict is None else {name: value.detach().float().cpu() for name, value in state_dict.items()}


def save(cache, source, spec):
    """Train SAVE_STEPS steps and save; record the gathered optimizer states, then go on training
    uninterrupted for RESUME_STEPS steps and record their losses."""
    stage, tp_size, dp_size, dtype, optimizer, *model = spec
    assert dist.get_world_size() == tp_size * dp_size
    folder = os.path.join(cache, source)
    uneven = "uneven" in model
    engine = initialize(stage, tp_size, dtype, optimizer, uneven=uneven, tied="tied" in model)
    train_engine(engine, tp_size, SAVE_STEPS, uneven=uneven)
    engine.save_checkpoint(folder, tag=TAG, client_state=CLIENT_STATE)
    states, steps = optimizer_states(engine, optimizer)
    groups_saved = param_group_hyperparameters(engine)
    losses = train_engine(engine, tp_size, RESUME_STEPS, uneven=uneven, first_step=SAVE_STEPS)
    whole = whole_states(engine, states, tp_size)
    if dist.get_rank() == 0:
        torch.save({"states": whole, "steps": steps, "param_groups": groups_saved}, os.path.join(folder, "states.pt"))
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
        _, tp_size, dp_size, *_ = request.module.SOURCES[source]
        method = f"test_ws{tp_size * dp_size}"
        run_source_test(request, f"TestSave::{method}[{source}]", CACHE_ENV, cache, os.path.join(folder, "done.json"))
    return folder


def load_and_train(folder,
                   spec,
                   dp_size,
                   universal_dir=None,
                   stage=None,
                   opened=None,
                   tp_size=None,
                   optimizer=None,
                   param_groups=None):
    """Load the source checkpoint ``spec`` saved in ``folder`` at ``dp_size`` (and ZeRO ``stage``, and
    tensor-parallel size ``tp_size``, and with the optimizer ``optimizer`` and the parameter groups
    that ``param_groups(model)`` builds), or with ``load_universal`` its conversion in
    ``universal_dir``, and check the resume. The paths that this rank opens during the load are added
    to the list ``opened``, if given."""
    global _opened
    saved_stage, saved_tp_size, saved_dp_size, dtype, saved_optimizer, *model = spec
    stage = saved_stage if stage is None else stage
    tp_size = saved_tp_size if tp_size is None else tp_size
    optimizer = saved_optimizer if optimizer is None else optimizer
    uneven = "uneven" in model
    assert dist.get_world_size() == tp_size * dp_size
    assert (dp_size != saved_dp_size or stage != saved_stage or tp_size != saved_tp_size or universal_dir
            or optimizer != saved_optimizer or param_groups)
    engine = initialize(stage,
                        tp_size,
                        dtype,
                        optimizer,
                        load_universal=universal_dir is not None,
                        uneven=uneven,
                        tied="tied" in model,
                        param_groups=param_groups or trainer_param_groups)
    _opened = opened
    try:
        if universal_dir is None:
            load_path, client_state = engine.load_checkpoint(folder, tag=TAG)
        else:
            load_path, client_state = engine.load_checkpoint(universal_dir, tag=UNIVERSAL_TAG)
    finally:
        _opened = None
    assert load_path is not None
    assert client_state["epoch"] == CLIENT_STATE["epoch"]
    assert engine.global_steps == SAVE_STEPS
    assert engine.lr_scheduler.last_batch_iteration == SAVE_STEPS - 1

    saved = assert_states_saved(engine, folder, optimizer, tp_size)
    # Each group's own: weight decay on the matrices only, each group's learning rate.
    hyperparameters = param_group_hyperparameters(engine)
    if optimizer != saved_optimizer:
        # A setting that the saving optimizer had not (CPU Adam's bias_correction) keeps this one's.
        hyperparameters = [{
            key: group[key]
            for key in saved_group
        } for group, saved_group in zip(hyperparameters, saved["param_groups"])]
    assert hyperparameters == saved["param_groups"]
    assert [group["weight_decay"] for group in saved["param_groups"]] == [0.1, 0.0]
    assert saved["param_groups"][0]["lr"] == 2 * saved["param_groups"][1]["lr"] > 0

    weights = full_weights(engine, stage, tp_size)
    if dist.get_rank() == 0:
        if dtype == torch.float32:
            expected = get_fp32_state_dict_from_zero_checkpoint(folder, tag=TAG)
        else:
            # zero_to_fp32 does not read the BF16 optimizer's checkpoints: the saved fp32 weights.
            expected = {
                name: param_states["fp32"].view(weights[name].shape)
                for name, param_states in saved["states"].items()
            }
            expected[PLACEHOLDER] = torch.zeros(0)
            if "tied" in model:
                expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
        assert sorted(weights) == sorted(expected)
        for name, value in expected.items():
            # The module holds the fp32 master weights rounded to its dtype.
            assert torch.equal(weights[name], value.to(dtype).float()), name
    dist.barrier()

    losses = train_engine(engine, tp_size, RESUME_STEPS, uneven=uneven, first_step=SAVE_STEPS)
    with open(os.path.join(folder, "done.json")) as f:
        uninterrupted = json.load(f)["losses"]
    # bf16 forwards of other micro-batch sizes round differently.
    assert losses == pytest.approx(uninterrupted, rel=1e-5 if dtype == torch.float32 else 1e-2)
    engine.destroy()


def assert_states_saved(engine, folder, optimizer, tp_size=1):
    """Right after a load, the gathered fp32 weights and optimizer states of each parameter and the
    step counts are those saved in ``folder``; returns what was saved."""
    saved = torch.load(os.path.join(folder, "states.pt"))
    states, steps = optimizer_states(engine, optimizer)
    states = whole_states(engine, states, tp_size)
    # SGD counts no steps.
    assert steps == saved["steps"] == (set() if "sgd" in optimizer else {float(SAVE_STEPS)}), (steps, saved["steps"])
    assert sorted(states) == sorted(saved["states"])
    for name, param_states in states.items():
        for key, value in param_states.items():
            assert torch.equal(value, saved["states"][name][key]), f"{name} {key}"
    return saved


def assert_refused(engine, folder, match, tag=TAG):
    """The load raises on every rank before anything is loaded: the weights are those of the
    freshly initialized engine."""
    before = [param.detach().clone() for param in engine.module.parameters()]
    with pytest.raises(ZeRORuntimeException, match=match):
        engine.load_checkpoint(folder, tag=tag)
    assert all(torch.equal(param, value) for param, value in zip(engine.module.parameters(), before))
    assert engine.global_steps == 0
