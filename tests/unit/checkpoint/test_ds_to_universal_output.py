# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``ds_to_universal`` writes its output atomically and never replaces a folder it did not write:
a killed run leaves nothing ``load_universal`` takes for a checkpoint and a rerun succeeds, a
folder of the user's in the output's place is refused untouched, and an incomplete checkpoint (a
missing or truncated rank file) is refused before anything is written, naming the file.

On deepspeed 0.19.8 a killed run leaves ``<output>`` and ``latest_universal`` behind, and a missing
last rank file goes unnoticed.
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import zipfile

import pytest
import torch
import torch.nn as nn

import deepspeed
import deepspeed.comm as dist
from deepspeed.checkpoint.ds_to_universal import main as convert_to_universal

from unit.common import DistributedTest

HIDDEN = 16


class Model(nn.Module):

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(HIDDEN, 3 * HIDDEN), nn.ReLU(), nn.Linear(3 * HIDDEN, HIDDEN + 1))

    def forward(self, x):
        return self.layers(x).square().mean()


def make_engine(stage, load_universal=False):
    torch.manual_seed(0)
    model = Model()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-2,
                "torch_adam": True
            }
        },
        "zero_optimization": {
            "stage": stage
        },
        "checkpoint": {
            "load_universal": load_universal
        },
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def train(engine, steps, seed):
    generator = torch.Generator().manual_seed(seed + dist.get_rank())
    losses = []
    for _ in range(steps):
        loss = engine(torch.randn(2, HIDDEN, generator=generator))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def trained_checkpoint(stage, folder):
    """An engine after two steps, and its checkpoint in ``folder``, tag ``step2``."""
    engine = make_engine(stage)
    train(engine, 2, seed=1)
    engine.save_checkpoint(folder, tag="step2")
    return engine


def convert_args(input_folder, output_folder, workers=1):
    return argparse.Namespace(input_folder=input_folder,
                              output_folder=output_folder,
                              num_extract_workers=workers,
                              num_merge_workers=workers,
                              keep_temp_folder=False,
                              strict=True,
                              inject_missing_state=False)


def run_cli(input_folder, output_folder, workers, kill_after_saves=None):
    """The converter as users run it, in a process of its own; ``kill_after_saves`` SIGKILLs it
    right after it has written that many universal files, as an interrupted run would stop."""
    code = ["import sys, os, signal", "import deepspeed.checkpoint.ds_to_universal as dtu"]
    if kill_after_saves is not None:
        code += [
            "save, count = dtu._save_checkpoint, [0]", "def killing_save(path, sd):", "    save(path, sd)",
            "    count[0] += 1", f"    if count[0] == {kill_after_saves}:",
            "        os.kill(os.getpid(), signal.SIGKILL)", "dtu._save_checkpoint = killing_save"
        ]
    code += ["dtu.main(dtu.parse_arguments())"]
    args = [
        "--input_folder", input_folder, "--output_folder", output_folder, "--num_extract_workers",
        str(workers), "--num_merge_workers",
        str(workers)
    ]
    return subprocess.run([sys.executable, "-c", "\n".join(code)] + args,
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT,
                          text=True)


def universal_files(folder):
    """The per-parameter files loaded, the global optimizer state's keys, the copied model-state
    files as bytes (they hold objects that do not compare by value)."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            key = os.path.relpath(path, folder)
            if os.path.dirname(os.path.dirname(key)) == "zero":
                # a complete zip archive, its checksums included
                assert zipfile.ZipFile(path).testzip() is None, key
                files[key] = torch.load(path, weights_only=False)
            elif key == os.path.join("zero", "optimizer_state.pt"):
                # Written anew each run (torch.save stamps every archive with a serialization id).
                files[key] = sorted(torch.load(path, weights_only=False))
            else:
                with open(path, "rb") as f:
                    files[key] = f.read()
    return files


def assert_same(actual, expected, where=""):
    if isinstance(expected, dict):
        assert sorted(actual) == sorted(expected), where
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}/{key}")
    elif torch.is_tensor(expected):
        assert torch.is_tensor(actual) and actual.dtype == expected.dtype, where
        assert torch.equal(actual, expected), where
    else:
        assert actual == expected, where


@pytest.mark.parametrize("stage", [2, 3])
class TestDsToUniversalOutput(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test(self, stage, tmpdir):
        folder = str(tmpdir)
        engine = trained_checkpoint(stage, folder)
        dist.barrier()
        checkpoint = os.path.join(folder, "step2")
        if dist.get_rank() == 0:
            universal = os.path.join(folder, "step2_universal")
            convert_to_universal(convert_args(checkpoint, universal))
            assert not [name for name in os.listdir(folder) if name.endswith((".tmp", ".old"))]
            files = universal_files(universal)

            # A run killed half way leaves no output and no record; the rerun succeeds.
            interrupted = os.path.join(folder, "interrupted", "step2_universal")
            proc = run_cli(checkpoint, interrupted, workers=1, kill_after_saves=3)
            assert proc.returncode == -signal.SIGKILL, proc.stdout
            left = os.listdir(os.path.dirname(interrupted))
            assert len(left) == 1 and left[0].startswith(".step2_universal.") and left[0].endswith(".tmp"), left
            proc = run_cli(checkpoint, interrupted, workers=1)
            assert proc.returncode == 0, proc.stdout
            assert sorted(os.listdir(os.path.dirname(interrupted))) == ["latest_universal", "step2_universal"]
            assert_same(universal_files(interrupted), files)

            # A folder in the output's place that the conversion did not write is refused, untouched;
            # one beside it, even of a name like the conversion's temporary folders, is left alone.
            shutil.rmtree(universal)
            for taken in (universal, f"{interrupted}.tmp", f"{os.path.dirname(interrupted)}/.step2_universal.tmp"):
                os.makedirs(taken)
                with open(os.path.join(taken, "notes.txt"), "w") as f:
                    f.write("mine")
            with pytest.raises(FileExistsError, match="step2_universal, which ds_to_universal did not write"):
                convert_to_universal(convert_args(checkpoint, universal))
            convert_to_universal(convert_args(checkpoint, interrupted))
            for taken in (universal, f"{interrupted}.tmp", f"{os.path.dirname(interrupted)}/.step2_universal.tmp"):
                assert os.listdir(taken) == ["notes.txt"]
                with open(os.path.join(taken, "notes.txt")) as f:
                    assert f.read() == "mine"
            assert_same(universal_files(interrupted), files)

            # A file of the user's added to a converted folder keeps the conversion from replacing it,
            # and the refusal names that file.
            with open(os.path.join(interrupted, "notes.txt"), "w") as f:
                f.write("mine")
            added = "step2_universal/notes.txt, which ds_to_universal did not write"
            with pytest.raises(FileExistsError, match=added):
                convert_to_universal(convert_args(checkpoint, interrupted))
            os.remove(os.path.join(interrupted, "notes.txt"))
            assert_same(universal_files(interrupted), files)

            # An incomplete checkpoint is refused before anything is written, naming the file.
            optim_file = sorted(name for name in os.listdir(checkpoint) if name.endswith("optim_states.pt"))[-1]
            broken = os.path.join(folder, "broken")
            os.makedirs(broken)
            for name in os.listdir(checkpoint):
                if name != optim_file:
                    os.symlink(os.path.join(checkpoint, name), os.path.join(broken, name))
            with pytest.raises(FileNotFoundError, match=optim_file):
                convert_to_universal(convert_args(broken, os.path.join(folder, "broken_universal")))
            with open(os.path.join(checkpoint, optim_file), "rb") as f:
                data = f.read()
            with open(os.path.join(broken, optim_file), "wb") as f:
                f.write(data[:len(data) // 2])
            with pytest.raises(ValueError, match=optim_file):
                convert_to_universal(convert_args(broken, os.path.join(folder, "broken_universal")))
            assert not os.path.exists(os.path.join(folder, "broken_universal"))
        dist.barrier()
