# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A checkpoint saved without ZeRO keeps its optimizer states in its model states file, one saved
with ZeRO in its ZeRO optimizer files. A load of its optimizer states by an engine that reads them
from the other place is refused before anything is loaded, naming both, where a ZeRO engine called
the checkpoint incomplete ("... optim_states.pt (missing)"), and an engine without ZeRO failed with
an ``AttributeError`` or, for a ZeRO-3 checkpoint, called it incomplete. Its weights alone load
(``load_optimizer_states=False``), as the refusal says: a ZeRO-3 engine takes them from the model
states of a checkpoint saved without ZeRO, and an engine without ZeRO from the ZeRO-3 checkpoint's
optimizer files, where neither found them.
"""

import pytest
import torch

from deepspeed.utils import safe_get_full_fp32_param

from unit.common import DistributedTest
from unit.checkpoint.autotp_common import train_engine
from unit.checkpoint.zero_load_common import SAVE_STEPS, TAG, assert_refused, initialize


def fp32_weights(engine, stage):
    """Each parameter's whole fp32 weights: without ZeRO the fp32 module's own."""
    weights = {}
    for name, param in engine.module.named_parameters():
        # The zero-element placeholder has no fp32 weights under ZeRO.
        held = stage and getattr(param, "ds_numel", param.numel())
        weights[name] = (safe_get_full_fp32_param(param) if held else param.detach()).clone()
    return weights


def save(stage, folder):
    """Train SAVE_STEPS steps at ``stage`` and save; return the weights saved."""
    engine = initialize(stage, tp_size=1)
    train_engine(engine, 1, SAVE_STEPS)
    engine.save_checkpoint(folder, tag=TAG)
    weights = fp32_weights(engine, stage)
    engine.destroy()
    return weights


def load_weights(stage, folder, saved_weights):
    engine = initialize(stage, tp_size=1)
    engine.load_checkpoint(folder, tag=TAG, load_optimizer_states=False)
    weights = fp32_weights(engine, stage)
    assert all(torch.equal(weights[name], value) for name, value in saved_weights.items())
    engine.destroy()


class TestLoadOptimizerStates(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("stage", [2, 3])
    def test_saved_without_zero(self, stage, tmpdir):
        weights = save(0, str(tmpdir))
        engine = initialize(stage, tp_size=1)
        assert_refused(
            engine, str(tmpdir), rf"Cannot load the optimizer states of the checkpoint .*, saved without ZeRO, into "
            rf"this engine at ZeRO stage {stage}: .* Nothing was loaded; load it without ZeRO, or its weights alone "
            r"with load_optimizer_states=False")
        engine.destroy()
        load_weights(stage, str(tmpdir), weights)

    @pytest.mark.parametrize("stage", [2, 3])
    def test_saved_with_zero(self, stage, tmpdir):
        weights = save(stage, str(tmpdir))
        engine = initialize(0, tp_size=1)
        assert_refused(
            engine, str(tmpdir), rf"Cannot load the optimizer states of the checkpoint .*, saved with ZeRO stage "
            rf"{stage}, into this engine without ZeRO: .* Nothing was loaded; load it with ZeRO stage {stage}, or its "
            r"weights alone with load_optimizer_states=False")
        engine.destroy()
        load_weights(0, str(tmpdir), weights)
