# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A job that resumes a ZeRO checkpoint with another optimizer than the one that saved it is refused
before the optimizer states are loaded, naming the states that each keeps per element: the saved
run's moments would not go on. torch's SGD with momentum and Adagrad, the client optimizers of a
training script, with the Hugging Face Trainer's two parameter groups, saved at ZeRO-1 (bf16), -2
and -3 on 2 ranks: Adagrad's states into SGD, SGD's into Adagrad or Adam, on the same 2 ranks, on 1,
at another ZeRO stage and from the universal checkpoint that ``ds_to_universal`` writes; and
the checkpoint of SGD without momentum, which keeps no state, into Adam or Adagrad on 1 rank (the
run's step counts say that it took steps). The optimizer keeps its own states and hyperparameters.
The same optimizer with other settings (SGD without momentum) loads, and the saved hyperparameters
come back; and so does SGD without momentum on 1 rank.

Before, each of these loads succeeded. On the same ranks (deepspeed 0.19.8 too) torch's
``load_state_dict`` put the saved states in place of the optimizer's own, and its next step failed
(``KeyError: 'sum'``, ``KeyError: 'momentum'``). On another number of ranks, at another stage and
from a universal checkpoint, the optimizer went on training with fresh states of its own beside the
loaded ones (SGD's momentum, Adagrad's sums), or failed at its next step.
"""

import os

import pytest
import torch

from deepspeed.runtime.zero.utils import ZeRORuntimeException

from unit.common import DistributedTest
from unit.checkpoint.autotp_common import convert_to_universal_checkpoint, param_group_hyperparameters
from unit.checkpoint import zero_load_common
from unit.checkpoint.zero_load_common import OPTIMIZER_STATES, TAG, UNIVERSAL_TAG, initialize, load_and_train, save

# The fixtures: the folder the source checkpoints are saved in, once per session, and a test's source.
cache = zero_load_common.cache
saved = zero_load_common.saved

# Each source checkpoint: stage, tp, dp, dtype, optimizer. ZeRO-1 in bf16 runs the BF16 optimizer.
SOURCES = {
    "stage2-tp1dp2-sgd": (2, 1, 2, torch.float32, "sgd"),
    "stage2-tp1dp2-adagrad": (2, 1, 2, torch.float32, "adagrad"),
    "stage3-tp1dp2-sgd": (3, 1, 2, torch.float32, "sgd"),
    "stage3-tp1dp2-adagrad": (3, 1, 2, torch.float32, "adagrad"),
    "stage1-tp1dp2-sgd-bf16": (1, 1, 2, torch.bfloat16, "sgd"),
    "stage2-tp1dp2-plain_sgd": (2, 1, 2, torch.float32, "plain_sgd"),
}
# Each optimizer's class.
OPTIMIZER_NAMES = {"adam": "Adam", "sgd": "SGD", "plain_sgd": "SGD", "adagrad": "Adagrad"}


class TestSave(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("source", list(SOURCES))
    def test_ws2(self, source, cache):
        save(cache, source, SOURCES[source])

    @pytest.mark.parametrize("source, optimizer", [
        ("stage2-tp1dp2-sgd", "adagrad"),
        ("stage3-tp1dp2-adagrad", "sgd"),
        ("stage1-tp1dp2-sgd-bf16", "adagrad"),
    ])
    def test_same_size(self, source, optimizer, saved):
        assert_other_optimizer_refused(saved, SOURCES[source], SOURCES[source][0], optimizer)


class TestLoad(DistributedTest):
    world_size = 1
    reuse_dist_env = True

    @pytest.mark.parametrize("source, stage, optimizer", [
        ("stage2-tp1dp2-adagrad", 2, "sgd"),
        ("stage3-tp1dp2-sgd", 3, "adagrad"),
        ("stage2-tp1dp2-sgd", 3, "adam"),
        ("stage2-tp1dp2-plain_sgd", 2, "adam"),
        ("stage2-tp1dp2-plain_sgd", 3, "adagrad"),
    ])
    def test_ws1(self, source, stage, optimizer, saved):
        assert_other_optimizer_refused(saved, SOURCES[source], stage, optimizer)

    @pytest.mark.parametrize("source", ["stage2-tp1dp2-plain_sgd"])
    def test_plain_sgd(self, source, saved):
        load_and_train(saved, SOURCES[source], dp_size=1)

    @pytest.mark.parametrize("source", ["stage2-tp1dp2-adagrad"])
    def test_universal(self, source, saved, tmpdir):
        convert_to_universal_checkpoint(os.path.join(saved, TAG), os.path.join(str(tmpdir), UNIVERSAL_TAG))
        assert_other_optimizer_refused(str(tmpdir), SOURCES[source], 1, "sgd", load_universal=True)

    @pytest.mark.parametrize("source", ["stage2-tp1dp2-sgd"])
    def test_other_settings(self, source, saved):
        # The same optimizer with other settings keeps the same states: it loads, and the saved
        # hyperparameters come back with them (SGD without momentum keeps none).
        engine = initialize(2, tp_size=1, optimizer="sgd")
        for group in engine.optimizer.optimizer.param_groups:
            group["momentum"] = 0.0
        engine.load_checkpoint(saved, tag=TAG)
        assert param_group_hyperparameters(engine) == torch.load(os.path.join(saved, "states.pt"))["param_groups"]
        assert all(group["momentum"] == 0.9 for group in engine.optimizer.optimizer.param_groups)
        engine.destroy()


def assert_other_optimizer_refused(folder, spec, stage, optimizer, load_universal=False):
    """A job with ``optimizer`` loading the checkpoint ``spec`` saved with another is refused, naming
    the states each keeps, and its optimizer keeps its own states and hyperparameters."""
    _, _, _, dtype, saved_optimizer = spec
    engine = initialize(stage, tp_size=1, dtype=dtype, optimizer=optimizer, load_universal=load_universal)
    hyperparameters = param_group_hyperparameters(engine)
    states = base_optimizer_states(engine)
    name = OPTIMIZER_NAMES[optimizer]
    saved_names, kept_names = (", ".join(OPTIMIZER_STATES[key]) or "none" for key in (saved_optimizer, optimizer))
    match = (rf"into this {name} optimizer: for each element of parameter group 0 the checkpoint holds "
             rf"{saved_names}, and {name} keeps {kept_names}, so the saved run would not go on\. .* The optimizer "
             r"states were not loaded")
    with pytest.raises(ZeRORuntimeException, match=match):
        engine.load_checkpoint(folder, tag=UNIVERSAL_TAG if load_universal else TAG)
    assert param_group_hyperparameters(engine) == hyperparameters
    # Its own states: none before its first step but Adagrad's, created with it.
    after = base_optimizer_states(engine)
    assert len(after) == len(states) == (len(engine.optimizer.optimizer.param_groups) if optimizer == "adagrad" else 0)
    for param_states, saved_states in zip(after, states):
        assert sorted(param_states) == sorted(saved_states)
        assert all(torch.equal(value, saved_states[key]) for key, value in param_states.items())
    engine.destroy()


def base_optimizer_states(engine):
    """The tensors the torch optimizer under ZeRO keeps for each of its parameters (flat partitions)."""
    return [{
        key: value.clone()
        for key, value in state.items() if torch.is_tensor(value)
    } for state in engine.optimizer.optimizer.state.values()]
