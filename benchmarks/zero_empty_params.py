# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Cost of zero-element parameters under ZeRO-3: collectives per step and step time.

One run measures, at world size 2 (gloo on CPU unless an accelerator is present):

* a ZeRO-3 model of sized layers plus K submodules whose parameters all have zero elements
  (``Linear(h, 0)``, as an adapter at rank 0), for K = 0, 16, 256, on the fork and on upstream
  0.19.8 with only the gather-gate fix (patch 0002): all-gathers, reduce-scatters and all-reduces
  per training step, and the median step time; and, as a control, the fork with K submodules
  that have no parameters at all (what ZeRO-3's per-module hooks cost on any model);
* the step-time ratio fork / unpatched upstream on the same model without empty parameters
  (K = 0), alternating the two several times.

The three variants are built from the pinned upstream sdist and this repository's patch series
(nothing is installed); each runs from its source tree. Usage, from the repository root:

    python benchmarks/zero_empty_params.py [--steps 20] [--repeats 3] [--json results.json]

Needs torch and the fork's test requirements; set DS_FORK_SDIST to use a local copy of the sdist.
"""

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HIDDEN = 256
SIZED_LAYERS = 4
BATCH = 8
# By subject, not number: a refresh onto a new release renumbers the series.
GATE_ONLY_SUBJECT = "zero3: gate the fetch all-gather on pending status, not numel"


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prepare_trees(workdir):
    """Source trees of upstream, upstream + the gate fix, and the fork, under ``workdir``."""
    sys.path.insert(0, str(REPO))
    from forktools.series import apply_series, read_series
    from forktools.upstream import fetch_sdist, read_pin, unpack_sdist

    pin = read_pin(REPO)
    patches = read_series(REPO)
    sdist = fetch_sdist(pin, workdir / "download")
    variants = {
        "upstream": [],
        "gate-only": [p for p in patches if p.subject == GATE_ONLY_SUBJECT],
        "fork": patches,
    }
    if not variants["gate-only"]:
        sys.exit(f"no patch with the subject {GATE_ONLY_SUBJECT!r} in the series (merged upstream?): "
                 "there is no gate-only variant to compare with")
    trees = {}
    for variant, variant_patches in variants.items():
        # Always from the pristine sdist: a tree left by an earlier run may hold an older series.
        shutil.rmtree(workdir / variant, ignore_errors=True)
        tree = unpack_sdist(pin, sdist, workdir / variant)
        apply_series(tree, variant_patches)
        trees[variant] = tree
    return trees


def run_variant(tree, num_empty, steps, ext_dir, parameterless=False):
    """Run the worker on 2 ranks against ``tree``; return rank 0's measurement."""
    env = dict(os.environ, PYTHONPATH=str(tree), TORCH_EXTENSIONS_DIR=str(ext_dir))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
        str(free_port()), __file__, "--worker", "--num-empty",
        str(num_empty), "--steps",
        str(steps)
    ] + (["--parameterless"] if parameterless else [])
    proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = "\n".join(proc.stdout.splitlines()[-5:])
    return {"error": tail}


def worker(num_empty, steps, parameterless):
    import torch
    import torch.nn as nn
    import deepspeed
    import deepspeed.comm as dist

    class NoParameters(nn.Module):
        """The control: a submodule with no parameters at all, computing the same empty output."""

        def forward(self, x):
            return x[..., :0]

    class Model(nn.Module):

        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN) for _ in range(SIZED_LAYERS)])
            empty_cls = NoParameters if parameterless else lambda: nn.Linear(HIDDEN, 0, bias=False)
            self.empties = nn.ModuleList([empty_cls() for _ in range(num_empty)])

        def forward(self, x):
            for layer in self.layers:
                x = torch.relu(layer(x))
            for empty in self.empties:
                x = x + empty(x).sum()
            return x.square().mean()

    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = Model()
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "steps_per_print": 10**9,
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
        "comms_logger": {
            "enabled": True,
            "prof_all": True
        },
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(BATCH, HIDDEN).to(engine.device)
    warmup = 3
    times = []
    counts = {}
    for step in range(warmup + steps):
        if step == warmup:
            dist.reset_log()
        dist.barrier()
        start = time.perf_counter()
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        dist.barrier()
        if step == warmup:
            # Collectives of one step (the first measured one), by operation.
            counts = {
                name: sum(entry[0] for entry in by_size.values())
                for name, by_size in dist.comms_logger.comms_dict.items() if name != "barrier"
            }
            dist.configure(enabled=False)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"collectives": counts, "step_ms": 1000 * statistics.median(times)}), flush=True)


def collective_summary(counts):
    gathers = sum(n for name, n in counts.items() if "all_gather" in name)
    reduce_scatters = sum(n for name, n in counts.items() if "reduce_scatter" in name)
    all_reduces = sum(n for name, n in counts.items() if "all_reduce" in name)
    return gathers, reduce_scatters, all_reduces


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="measured steps per run (after 3 warm-up steps)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating fork/upstream runs for the ratio")
    parser.add_argument("--num-empty", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--parameterless", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--work-dir", default=str(REPO / "build" / "bench-zero-empty-params"))
    args = parser.parse_args()
    if args.worker:
        worker(args.num_empty, args.steps, args.parameterless)
        return

    workdir = Path(args.work_dir)
    workdir.mkdir(parents=True, exist_ok=True)
    trees = prepare_trees(workdir / "trees")
    ext_dir = workdir / "torch-extensions"
    results = {"empty_submodules": [], "ratio_runs": []}

    print("| K empty submodules | variant | all-gathers/step | reduce-scatters/step | all-reduces/step | step ms |")
    print("|---|---|---|---|---|---|")
    for num_empty in (0, 16, 256):
        # The control row: K submodules without parameters cost what ZeRO-3's module hooks cost, on
        # any model; the fork's empty submodules should cost the same.
        for variant in ("gate-only", "fork", "fork, control: parameterless submodules"):
            tree = trees["fork" if variant.startswith("fork") else variant]
            result = run_variant(tree,
                                 num_empty,
                                 args.steps,
                                 ext_dir / variant.split(",")[0],
                                 parameterless="control" in variant)
            results["empty_submodules"].append(dict(result, variant=variant, num_empty=num_empty))
            if "error" in result:
                print(f"| {num_empty} | {variant} | failed: {result['error']!r} |")
                continue
            gathers, reduce_scatters, all_reduces = collective_summary(result["collectives"])
            print(
                f"| {num_empty} | {variant} | {gathers} | {reduce_scatters} | {all_reduces} | "
                f"{result['step_ms']:.2f} |",
                flush=True)

    step_ms = {"upstream": [], "fork": []}
    for _ in range(args.repeats):
        for variant in ("upstream", "fork"):
            result = run_variant(trees[variant], 0, args.steps, ext_dir / variant)
            results["ratio_runs"].append(dict(result, variant=variant))
            if "error" in result:
                sys.exit(f"{variant} failed on a model without empty parameters: {result['error']}")
            step_ms[variant].append(result["step_ms"])
    fork_ms, upstream_ms = statistics.median(step_ms["fork"]), statistics.median(step_ms["upstream"])
    results["step_time_ratio_fork_over_upstream"] = fork_ms / upstream_ms
    print(f"\nK = 0, median of {args.repeats} alternating runs of {args.steps} steps: fork {fork_ms:.2f} ms, "
          f"upstream {upstream_ms:.2f} ms, ratio fork/upstream {fork_ms / upstream_ms:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
