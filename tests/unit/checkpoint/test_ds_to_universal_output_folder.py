# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``ds_to_universal`` given an ``--output_folder`` that already holds files of the user's (a folder
of other work, given by mistake) refuses it before anything is written, naming the folder, and
leaves every file in it as it was; an empty folder converts.

On deepspeed 0.19.8 the conversion writes into the folder and, when it ends, removes the folder's
``tmp`` subfolder with everything in it.
"""

import argparse
import os

import pytest
import torch
import torch.nn as nn

import deepspeed
import deepspeed.comm as dist
from deepspeed.checkpoint.ds_to_universal import main as convert_to_universal

from unit.common import DistributedTest

HIDDEN = 16


def convert_args(input_folder, output_folder):
    return argparse.Namespace(input_folder=input_folder,
                              output_folder=output_folder,
                              num_extract_workers=1,
                              num_merge_workers=1,
                              keep_temp_folder=False,
                              strict=True,
                              inject_missing_state=False)


def folder_contents(folder):
    contents = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path) as f:
                contents[os.path.relpath(path, folder)] = f.read()
    return contents


class TestDsToUniversalOutputFolder(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test(self, tmpdir):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {
                "type": "Adam",
                "params": {
                    "lr": 1e-2,
                    "torch_adam": True
                }
            },
            "zero_optimization": {
                "stage": 3
            },
        }
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        loss = engine(torch.randn(2, HIDDEN)).square().mean()
        engine.backward(loss)
        engine.step()
        engine.save_checkpoint(str(tmpdir), tag="step1")
        dist.barrier()
        if dist.get_rank() == 0:
            checkpoint = os.path.join(str(tmpdir), "step1")
            output = os.path.join(str(tmpdir), "work")
            os.makedirs(os.path.join(output, "tmp"))
            for name in ("notes.txt", os.path.join("tmp", "run.log")):
                with open(os.path.join(output, name), "w") as f:
                    f.write(f"{name} is mine")
            before = folder_contents(output)
            with pytest.raises(FileExistsError, match=r"\bwork\b"):
                convert_to_universal(convert_args(checkpoint, output))
            assert folder_contents(output) == before
            assert sorted(os.listdir(output)) == ["notes.txt", "tmp"]
            assert not os.path.exists(os.path.join(str(tmpdir), "latest_universal"))

            empty = os.path.join(str(tmpdir), "step1_universal")
            os.makedirs(empty)
            convert_to_universal(convert_args(checkpoint, empty))
            assert os.path.isdir(os.path.join(empty, "zero", "0.weight"))
        dist.barrier()
        engine.destroy()
