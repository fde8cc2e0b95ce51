# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""One side of the universal checkpoint format check, run by test_universal_cross_version.py with
whichever deepspeed is on PYTHONPATH (the fork, or the pinned upstream release):

  save FOLDER            train a small model 2 steps at ZeRO-2 and ZeRO-3, save checkpoints and
                         what a restore must reproduce (weights, the next 2 losses)
  convert FOLDER NAME    ds_to_universal each checkpoint into FOLDER/stageN/NAME
  load FOLDER NAME       restore FOLDER/stageN/NAME with load_universal and check it
  resume FOLDER          restore the checkpoints themselves (no conversion) and check them

Runs as a single rank (world size 1).
"""

import argparse
import os
import sys
from pathlib import Path

import torch

import deepspeed

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# The model, config and training of the fork's own streaming test.
from unit.checkpoint.test_ds_to_universal_output import make_engine, train  # noqa: E402

STAGES = (2, 3)
STEPS = 2


def weights(engine):
    result = {}
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            result[name] = param.detach().clone()
    return result


def main():
    mode, folder = sys.argv[1], sys.argv[2]
    deepspeed.init_distributed(dist_backend="gloo")
    for stage in STAGES:
        stage_folder = os.path.join(folder, f"stage{stage}")
        if mode == "save":
            engine = make_engine(stage)
            train(engine, STEPS, seed=1)
            engine.save_checkpoint(stage_folder, tag="step2")
            expected = {"weights": weights(engine), "next_losses": train(engine, STEPS, seed=2)}
            torch.save(expected, os.path.join(stage_folder, "expected.pt"))
        elif mode == "convert":
            from deepspeed.checkpoint.ds_to_universal import main as convert
            convert(
                argparse.Namespace(input_folder=os.path.join(stage_folder, "step2"),
                                   output_folder=os.path.join(stage_folder, sys.argv[3]),
                                   num_extract_workers=1,
                                   num_merge_workers=1,
                                   keep_temp_folder=False,
                                   strict=True,
                                   inject_missing_state=True))
        elif mode in ("load", "resume"):
            expected = torch.load(os.path.join(stage_folder, "expected.pt"))
            engine = make_engine(stage, load_universal=mode == "load")
            engine.load_checkpoint(stage_folder, tag=sys.argv[3] if mode == "load" else "step2")
            restored = weights(engine)
            for name, value in expected["weights"].items():
                assert torch.equal(restored[name], value), f"stage {stage}: {name} differs after the restore"
            losses = train(engine, STEPS, seed=2)
            assert losses == expected["next_losses"], f"stage {stage}: {losses} != {expected['next_losses']}"
        else:
            raise SystemExit(f"unknown mode {mode}")
    print(f"OK {mode} deepspeed {deepspeed.__version__}")
    # Shut the process group down before the interpreter does: left to exit, the process can abort in
    # teardown ("terminate called without an active exception") after it has finished.
    deepspeed.comm.destroy_process_group()


if __name__ == "__main__":
    main()
