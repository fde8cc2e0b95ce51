# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A ZeRO checkpoint of any optimizer resumes on another data-parallel size, and converts with
``ds_to_universal``: each state the optimizer keeps per element moves under the optimizer's own
name (SGD's ``momentum_buffer``, Adagrad's ``sum``), and its step count with it. torch's SGD with
momentum and Adagrad, the client optimizers of a training script, with the Hugging Face Trainer's
two parameter groups, saved at ZeRO-2 and -3 on 2 ranks, resume on 1: right after the load the
gathered optimizer states, the step counts and each group's hyperparameters are the saved ones,
and the next losses are those of the run that went on uninterrupted; the same from the universal
checkpoint that ``ds_to_universal`` writes of them, loaded with ``load_universal``.

A state that is neither one value per element nor a step count (ASGD's ``eta``) is refused before
anything is loaded, naming the optimizer and the state.

On deepspeed 0.19.8 a load on another data-parallel size is refused whatever the optimizer, and
``ds_to_universal`` of these checkpoints fails with ``KeyError: 'exp_avg'`` (upstream issue #8608,
for DeepSpeed's Muon).
"""

import os

import pytest
import torch

from unit.common import DistributedTest
from unit.checkpoint.autotp_common import convert_to_universal_checkpoint
from unit.checkpoint import zero_load_common
from unit.checkpoint.zero_load_common import TAG, UNIVERSAL_TAG, assert_refused, initialize, load_and_train, save

# The fixtures: the folder the source checkpoints are saved in, once per session, and a test's source.
cache = zero_load_common.cache
saved = zero_load_common.saved

# Each source checkpoint: stage, tp, dp, dtype, optimizer.
SOURCES = {
    f"stage{stage}-tp1dp2-{name}": (stage, 1, 2, torch.float32, name)
    for stage in (2, 3)
    for name in ("sgd", "adagrad")
}
SOURCES["stage2-tp1dp2-asgd"] = (2, 1, 2, torch.float32, "asgd")


class TestSave(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("source", list(SOURCES))
    def test_ws2(self, source, cache):
        save(cache, source, SOURCES[source])


class TestLoad(DistributedTest):
    world_size = 1
    reuse_dist_env = True

    @pytest.mark.parametrize("source", [name for name in SOURCES if not name.endswith("asgd")])
    def test_ws1(self, source, saved):
        load_and_train(saved, SOURCES[source], dp_size=1)

    @pytest.mark.parametrize("source", ["stage2-tp1dp2-adagrad", "stage3-tp1dp2-sgd"])
    def test_universal(self, source, saved, tmpdir):
        convert_to_universal_checkpoint(os.path.join(saved, TAG), os.path.join(str(tmpdir), UNIVERSAL_TAG))
        load_and_train(saved, SOURCES[source], dp_size=1, universal_dir=str(tmpdir))

    @pytest.mark.parametrize("source", ["stage2-tp1dp2-asgd"])
    def test_refuse_scalar_state(self, source, saved):
        # ASGD's "eta" is a scalar of its own, not a step count: named, not dropped.
        engine = initialize(2, tp_size=1, optimizer="asgd")
        match = r"the ASGD optimizer's state 'eta' \(\(\)\) is neither one value per element .* nor a step count"
        assert_refused(engine, saved, match + r"\. Nothing was loaded; load it at data-parallel size 2")
