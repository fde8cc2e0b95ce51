# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""One side of the zero-element parameter checkpoint check, run by
test_universal_cross_version.py with whichever deepspeed is on PYTHONPATH:

  save FOLDER    (upstream 0.19.8) save a ZeRO-3 checkpoint of a model with zero-element
                 parameters right after deepspeed.initialize: 0.19.8 cannot run its forward
  load FOLDER    (the fork) load it with and without optimizer states, check the weights and
                 the parameters' shapes, train a step; consolidate it with zero_to_fp32

0.19.8 writes every ZeRO-3 parameter, zero-element ones included, as a (0,) placeholder in the
module state dict; the fork keeps zero-element parameters in their declared shape.
Runs as a single rank (world size 1).
"""

import os
import sys
from pathlib import Path

import torch

import deepspeed
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from unit.runtime.zero.test_zero_empty_params import HIDDEN, MODELS, zero_config  # noqa: E402
from universal_cross_version import weights  # noqa: E402

TAG = "init"


def make_engine(model_cls, seed):
    torch.manual_seed(seed)
    model = model_cls()
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           model_parameters=model.parameters(),
                                           config=zero_config(3, torch.float32))
    return engine


def main():
    mode, folder = sys.argv[1], sys.argv[2]
    deepspeed.init_distributed(dist_backend="gloo")
    for model_name, model_cls in MODELS.items():
        model_folder = os.path.join(folder, model_name)
        if mode == "save":
            engine = make_engine(model_cls, seed=1)
            engine.save_checkpoint(model_folder, tag=TAG)
            torch.save(weights(engine), os.path.join(model_folder, "expected.pt"))
        elif mode == "load":
            expected = torch.load(os.path.join(model_folder, "expected.pt"))
            for load_optimizer_states in (True, False):
                engine = make_engine(model_cls, seed=2)
                engine.load_checkpoint(model_folder, tag=TAG, load_optimizer_states=load_optimizer_states)
                restored = weights(engine)
                for name, value in expected.items():
                    assert restored[name].shape == value.shape, f"{model_name}: {name} {restored[name].shape}"
                    assert torch.equal(restored[name], value), f"{model_name}: {name} differs after the load"
                x = torch.randn(2, HIDDEN)
                loss = engine(x)
                engine.backward(loss)
                engine.step()
                assert torch.isfinite(loss), f"{model_name}: loss {loss}"
            state_dict = get_fp32_state_dict_from_zero_checkpoint(model_folder, tag=TAG)
            assert {name: value.shape for name, value in state_dict.items()} == {
                name: value.shape
                for name, value in expected.items()
            }, f"{model_name}: zero_to_fp32 shapes"
        else:
            raise SystemExit(f"unknown mode {mode}")
    print(f"OK {mode} deepspeed {deepspeed.__version__}")
    # Shut the process group down before the interpreter does: left to exit, the process can abort in
    # teardown ("terminate called without an active exception") after it has finished.
    deepspeed.comm.destroy_process_group()


if __name__ == "__main__":
    main()
