# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Converting a checkpoint, or loading a universal one, never runs code from it.

``ds_to_universal`` reads the rank files with ``weights_only=True``, as ``load_checkpoint`` does: a
checkpoint whose optimizer file carries a pickled object whose ``__reduce__`` creates a file (a
stand-in for any code) is refused, naming the file and the global, before any output is written,
and ``--no_weights_only`` converts a checkpoint the user trusts as before. A universal checkpoint
one of whose files carries such an object is refused by ``load_checkpoint`` with
``"load_universal": true``, and the file is never created.

On deepspeed 0.19.8 every reader unpickles with ``weights_only=False``, and the payload runs.
"""

import argparse
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

import deepspeed
from deepspeed.checkpoint.ds_to_universal import main as convert_to_universal

from unit.checkpoint.test_checkpoint_weights_only import Payload, build_model, plant_payload, train_step
from unit.common import DistributedTest

OPTIMIZER_FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def initialize(load_universal=False):
    model = build_model()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-2,
                "torch_adam": True
            }
        },
        "zero_optimization": {
            "stage": 2
        },
        "checkpoint": {
            "load_universal": load_universal
        },
    }
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    return engine


def universal_args(input_folder, output_folder):
    # inject_missing_state: 0.19.8 converts a plain ZeRO-1/2 checkpoint only with it.
    return argparse.Namespace(input_folder=input_folder,
                              output_folder=output_folder,
                              num_extract_workers=1,
                              num_merge_workers=1,
                              keep_temp_folder=False,
                              strict=True,
                              inject_missing_state=True,
                              weights_only=True)


def run(module, *args):
    return subprocess.run([sys.executable, "-m", module, *args],
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT,
                          text=True,
                          timeout=300)


class TestUniversalCheckpointWeightsOnly(DistributedTest):
    world_size = 1

    def test_payload_is_refused_unless_told_to_trust_it(self, tmpdir):
        save_dir = str(tmpdir)
        marker = os.path.join(save_dir, "payload_ran")
        engine = initialize()
        train_step(engine)
        engine.save_checkpoint(save_dir, tag="good")
        shutil.copytree(os.path.join(save_dir, "good"), os.path.join(save_dir, "payload"))
        plant_payload(os.path.join(save_dir, "payload"), OPTIMIZER_FILE, marker)

        output = os.path.join(save_dir, "payload_universal")
        with pytest.raises(pickle.UnpicklingError, match=f"{OPTIMIZER_FILE} needs io.open"):
            convert_to_universal(universal_args(os.path.join(save_dir, "payload"), output))
        assert not os.path.exists(output)
        refused = run("deepspeed.checkpoint.ds_to_universal", "--input_folder", os.path.join(save_dir, "payload"),
                      "--output_folder", output, "--inject_missing_state")
        assert refused.returncode != 0 and "io.open" in refused.stdout, refused.stdout
        assert not os.path.exists(marker) and not os.path.exists(output)
        trusted = run("deepspeed.checkpoint.ds_to_universal", "--input_folder", os.path.join(save_dir, "payload"),
                      "--output_folder", output, "--inject_missing_state", "--no_weights_only")
        assert trusted.returncode == 0, trusted.stdout
        assert os.path.exists(marker) and os.path.isdir(os.path.join(output, "zero"))
        os.remove(marker)

        # A universal checkpoint with the payload in one parameter's fp32 weights.
        universal = os.path.join(save_dir, "universal")
        convert_to_universal(universal_args(os.path.join(save_dir, "good"), universal))
        fp32_path = os.path.join(universal, "zero", "model.embed_tokens.weight", "fp32.pt")
        state = torch.load(fp32_path, weights_only=False)
        assert isinstance(state, dict)
        state["payload"] = Payload(marker)
        torch.save(state, fp32_path)
        fresh = initialize(load_universal=True)
        with pytest.raises(pickle.UnpicklingError, match="io.open"):
            fresh.load_checkpoint(save_dir, tag="universal")
        assert not os.path.exists(marker), "the payload in the universal checkpoint ran"
