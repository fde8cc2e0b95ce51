# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The load-time check of a checkpoint's rank files: file opens and wall time per rank, by world size.

``load_checkpoint`` refuses a tag with a missing, truncated or unsafe rank file before it loads
anything, on every rank. Until the check was made to scale, each rank checked every rank's files
(at ZeRO-3, N model-state and N optimizer files), so a restart of N ranks opened about 2N files per
rank, 2N^2 in all, on the shared filesystem. Now each rank checks the files it reads and one
``all_gather_object`` shares what every rank found.

This measures one rank's side of the check (``DeepSpeedEngine._check_checkpoint_files`` in a
world of one rank, so the collective is trivial) on synthetic ZeRO-3 tags of 64, 512 and 4096
ranks: small but well-formed files, each optimizer file pickling what DeepSpeed's do
(``ZeroStageEnum``, a ``LossScaler``), so the globals scan reads a real pickle. "every rank's
files" is what each rank checked before, "own files" what rank 0 checks now. Opens are counted
with an audit hook (Python-level ``open`` calls); time is the median of ``--repeats`` runs, page
cache warm. Usage, from the repository root, with the fork installed:

    python benchmarks/checkpoint_load_check.py [--ranks 64,512,4096] [--repeats 5]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

OPENED = []


def count_opens(event, args):
    if event == "open":
        OPENED.append(args[0])


def synthesize(folder, ranks):
    """A ZeRO-3 tag of ``ranks`` ranks: one model-state and one optimizer file per rank."""
    import torch
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    os.makedirs(folder)
    model_state = {"module": None, "dp_world_size": ranks, "mp_world_size": 1, "param_shapes": [{"w": (1, )}]}
    optim_state = {
        "optimizer_state_dict": {
            "zero_stage": ZeroStageEnum.weights,
            "loss_scaler": LossScaler(1.0),
            "fp32_flat_groups": [torch.zeros(1)]
        }
    }
    for rank in range(ranks):
        torch.save(model_state, os.path.join(folder, f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"))
        torch.save(optim_state, os.path.join(folder, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))


def rank_files(folder, ranks):
    return [
        os.path.join(folder, f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt") for rank in ranks
        for kind in ("model", "optim")
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="64,512,4096", help="comma-separated world sizes")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29519", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine
    deepspeed.init_distributed(dist_backend="gloo")
    sys.addaudithook(count_opens)

    print("| ranks | files checked by rank 0 | opens per rank | time per rank, ms: median (runs) |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="checkpoint-load-check-") as root:
        for ranks in [int(n) for n in args.ranks.split(",")]:
            tag = os.path.join(root, f"ranks{ranks}", "global_step1")
            synthesize(tag, ranks)
            for label, paths in (("every rank's files", rank_files(tag,
                                                                   range(ranks))), ("own files", rank_files(tag,
                                                                                                            [0]))):
                times = []
                for _ in range(args.repeats):
                    OPENED.clear()
                    start = time.perf_counter()
                    # The check does not use the engine: it is called unbound, as a function.
                    DeepSpeedEngine._check_checkpoint_files(None, os.path.dirname(tag), "global_step1", paths)
                    times.append(1000 * (time.perf_counter() - start))
                runs = ", ".join(f"{t:.1f}" for t in times)
                print(
                    f"| {ranks} | {label} ({len(paths)}) | {len(OPENED)} | {statistics.median(times):.1f} ({runs}) |",
                    flush=True)


if __name__ == "__main__":
    main()
