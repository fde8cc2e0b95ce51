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

The second table is one rank's side of a load of the same tags at half the data-parallel size
(M = N/2), as the last new rank (M - 1) does it, each run in a fresh process: the check of the
files it reads, then the read of its new ZeRO-3 partition of every parameter's fp32 weights and
Adam moments. "every file" is what each rank did before the load had a read plan (it checked
every optimizer file of its tensor-parallel rank, verified the CRC-32s of a 1/M share of them, and
mapped and unpickled all of them), replayed with the same functions; "files of its partition" is
what ``load_checkpoint`` does now (``ZeroRankFilesStates``: rank 0's file records the layout, the
others are checked and opened only where the partition lies). Bytes read are those of ``read()``
calls (``rchar`` of ``/proc/self/io``: zip headers, pickles, the CRC-32 pass over each verified
file); the tensors themselves are read from memory-mapped files, the same elements either way.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

OPENED = []


def count_opens(event, args):
    if event == "open":
        OPENED.append(args[0])


# The parameters of the synthetic model, each of PARTITION_NUMEL elements a rank.
PARAMS = [f"layers.{layer}.{name}.weight" for layer in range(2) for name in ("q", "k", "v", "o")]
PARTITION_NUMEL = 64


def param_shapes(ranks):
    import torch
    return [{name: torch.Size([ranks, PARTITION_NUMEL]) for name in PARAMS}]


def synthesize(folder, ranks):
    """A ZeRO-3 tag of ``ranks`` ranks: one model-state and one optimizer file per rank, each optimizer
    file holding its partition of every parameter's fp32 weights and Adam moments."""
    import torch
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    os.makedirs(folder)
    model_state = {"module": None, "dp_world_size": ranks, "mp_world_size": 1, "param_shapes": param_shapes(ranks)}
    flat_numel = len(PARAMS) * PARTITION_NUMEL
    for rank in range(ranks):
        optim_state = {
            "optimizer_state_dict": {
                "zero_stage": ZeroStageEnum.weights,
                "loss_scaler": LossScaler(1.0),
                "fp32_flat_groups": [torch.full((flat_numel, ), float(rank))],
                "optimizer_state_dict": {
                    "state": {
                        0: {
                            "step": torch.tensor(1.0),
                            "exp_avg": torch.zeros(flat_numel),
                            "exp_avg_sq": torch.zeros(flat_numel)
                        }
                    },
                    "param_groups": [{
                        "lr": 1e-3,
                        "params": [0]
                    }]
                }
            }
        }
        torch.save(model_state, os.path.join(folder, f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"))
        torch.save(optim_state, os.path.join(folder, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))


def rank_files(folder, ranks):
    return [
        os.path.join(folder, f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt") for rank in ranks
        for kind in ("model", "optim")
    ]


def bytes_read():
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def load_other_size(tag, ranks, plan):
    """One rank's side of a load of the tag at half its data-parallel size: the last new rank's."""
    from deepspeed.checkpoint.universal_checkpoint import ZeroRankFilesStates
    from deepspeed.checkpoint.utils import load_checkpoint_file
    from deepspeed.checkpoint.zero_layout import (FragmentReader, index_fragments, zero3_partition_range,
                                                  zero3_rank_fragments)
    from deepspeed.runtime.engine import DeepSpeedEngine
    load_dir, name = os.path.split(tag)
    files = [os.path.join(tag, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt") for rank in range(ranks)]
    new_ranks = ranks // 2
    new_rank = new_ranks - 1
    shapes = param_shapes(ranks)
    ranges = {name: zero3_partition_range(shape.numel(), new_ranks, new_rank) for name, shape in shapes[0].items()}
    if plan:
        # Which new rank verifies each file's CRC-32s, as the ranks agree on in one all_gather_object.
        states = ZeroRankFilesStates(files, shapes)
        first_reader = {}
        for rank in range(new_ranks):
            rank_ranges = {
                name: zero3_partition_range(shape.numel(), new_ranks, rank)
                for name, shape in shapes[0].items()
            }
            for dp_index in states.files(rank_ranges):
                first_reader.setdefault(dp_index, rank)
        del states
    OPENED.clear()
    before_bytes, start = bytes_read(), time.perf_counter()
    if plan:
        DeepSpeedEngine._check_checkpoint_files(None, load_dir, name, files[:1], [])
        states = ZeroRankFilesStates(files, shapes)
        reads = states.files(ranges)
        DeepSpeedEngine._check_checkpoint_files(None, load_dir, name, [files[i] for i in reads],
                                                [files[i] for i in reads if first_reader[i] == new_rank])
        for param, (first, numel) in ranges.items():
            for key in states.state_names(param):
                states.read(param, key, first, numel)
    else:
        DeepSpeedEngine._check_checkpoint_files(None, load_dir, name, files, files[new_rank::new_ranks])
        index = {}
        for dp_index, path in enumerate(files):
            optim_sd = load_checkpoint_file(path)["optimizer_state_dict"]
            index_fragments(index, zero3_rank_fragments(optim_sd, shapes, ranks, dp_index), 0, dp_index)
        reader = FragmentReader(index)
        for param, (first, numel) in ranges.items():
            for key in reader.state_names(param):
                reader.read(param, key, 0, first, numel)
    elapsed = 1000 * (time.perf_counter() - start)
    opened = {path for path in OPENED if path.endswith("_optim_states.pt")}
    return len(opened), len(OPENED), bytes_read() - before_bytes, elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="64,512,4096", help="comma-separated world sizes")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--load-other-size", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--plan", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    port = "29519" if args.load_other_size is None else "29520"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine
    deepspeed.init_distributed(dist_backend="gloo")
    sys.addaudithook(count_opens)
    if args.load_other_size is not None:
        tag, ranks = args.load_other_size
        print(json.dumps(load_other_size(tag, int(ranks), args.plan)))
        # Left to exit, the process can abort in teardown ("terminate called without an active
        # exception") after it has finished.
        deepspeed.comm.destroy_process_group()
        return

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

        print()
        print("| saved at N ranks, loaded at N/2 | the last rank checks and opens | optimizer files | opens | "
              "bytes read | ms, one run |")
        print("|---|---|---|---|---|---|")
        for ranks in [int(n) for n in args.ranks.split(",")]:
            tag = os.path.join(root, f"ranks{ranks}", "global_step1")
            for label, plan in (("every file", False), ("files of its partition", True)):
                cmd = [sys.executable, __file__, "--load-other-size", tag, str(ranks)] + (["--plan"] if plan else [])
                out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
                files, opens, nbytes, elapsed = json.loads(out.strip().splitlines()[-1])
                print(f"| {ranks} | {label} | {files} | {opens} | {nbytes / 2**20:.2f} MiB | {elapsed:.0f} |",
                      flush=True)
    deepspeed.comm.destroy_process_group()


if __name__ == "__main__":
    main()
