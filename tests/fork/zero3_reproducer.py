# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The ZeRO-3 reproducer of the zero-element gather bug, run under torch.distributed.run.

Upstream 0.19.8 stops at the first forward with
``AssertionError: {... 'status': 'NOT_AVAILABLE', 'numel': 0 ...}``; the fork trains.
"""

import torch
import torch.nn as nn

import deepspeed
import deepspeed.comm


class M(nn.Module):

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.empty = nn.Linear(8, 0, bias=False)

    def forward(self, x):
        return self.a(x).sum() + self.empty(x).sum()


def main():
    deepspeed.init_distributed(dist_backend="gloo")
    model = M()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-3,
                "torch_adam": True
            }
        },
        "zero_optimization": {
            "stage": 3
        },
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for _ in range(3):
        loss = engine(torch.randn(2, 8))
        engine.backward(loss)
        engine.step()
    print(f"OK deepspeed {deepspeed.__version__}", flush=True)
    # Shut the process group down before the interpreter does: left to exit, a rank can abort in
    # teardown ("terminate called without an active exception") after it has finished.
    deepspeed.comm.barrier()
    deepspeed.comm.destroy_process_group()


if __name__ == "__main__":
    main()
