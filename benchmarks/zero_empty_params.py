# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Cost of zero-element parameters under ZeRO-3: collectives per step and step time.

One run measures, at world sizes 1 and 2 (gloo on CPU unless an accelerator is present):

* a ZeRO-3 model of sized layers plus K submodules whose parameters all have zero elements
  (``Linear(h, 0)``, as an adapter at rank 0), for K = 16 and 256, on the fork and on upstream
  0.19.8 with only the gather-gate fix (patch 0002), beside a control: the same model with K
  ``Linear(h, 0)`` submodules whose weight is a buffer that requires grad instead of a parameter
  (the same computation and autograd graph), so that the ratio model / control is ZeRO-3's cost
  of the parameters alone. Each run trains the model and its control as two engines in one
  process, on the same build, stepping them in turn (ABBA) so that both see the same machine
  load, and builds them in the opposite order from the run before: all-gathers, reduce-scatters
  and all-reduces of one training step of each, and the median step times. Each row gives the
  median over ``--repeats`` runs of the per-run ratio of the medians, with its spread;
* the step-time ratio fork / unpatched upstream on the same model without empty parameters
  (K = 0), alternating the two ``--repeats`` times, with the spread of the per-pair ratios.

The three builds are made from the pinned upstream sdist and this repository's patch series
(nothing is installed); each runs from its source tree. Usage, from the repository root:

    python benchmarks/zero_empty_params.py [--steps 20] [--repeats 3] [--json results.json]

Needs torch and the fork's test requirements; set DS_FORK_SDIST to use a local copy of the sdist.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from checkpoint_tools import free_port

REPO = Path(__file__).resolve().parent.parent
HIDDEN = 256
SIZED_LAYERS = 4
BATCH = 8
# By subject, not number: a refresh onto a new release renumbers the series.
GATE_ONLY_SUBJECT = "zero3: gate the fetch all-gather on pending status, not numel"


def prepare_trees(workdir):
    """Source trees of upstream, upstream + the gate fix, and the fork, under ``workdir``."""
    sys.path.insert(0, str(REPO))
    from forktools.series import read_series
    from forktools.upstream import pinned_release

    patches = read_series(REPO)
    release = pinned_release(REPO, workdir)
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
        trees[variant] = release.tree(workdir / variant, variant_patches)
    return trees


def run_variant(tree, world_size, num_empty, steps, ext_dir, control=False, control_first=False):
    """Run the worker on ``world_size`` ranks against ``tree``; return rank 0's measurement."""
    env = dict(os.environ, PYTHONPATH=str(tree), TORCH_EXTENSIONS_DIR=str(ext_dir))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
        str(world_size), "--master_port",
        str(free_port()), __file__, "--worker", "--num-empty",
        str(num_empty), "--steps",
        str(steps)
    ] + (["--control"] if control else []) + (["--control-first"] if control_first else [])
    proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = "\n".join(proc.stdout.splitlines()[-5:])
    return {"error": tail}


def worker(num_empty, steps, control, control_first):
    """Train the model with ``num_empty`` empty submodules, and with ``control`` its control beside it
    (built first with ``control_first``: the engine built second runs slightly faster)."""
    import torch
    import torch.nn as nn
    import deepspeed
    import deepspeed.comm as dist

    class EmptyBuffer(nn.Linear):
        """The control: ``Linear(h, 0, bias=False)`` with its weight a buffer that requires grad."""

        def __init__(self):
            super().__init__(HIDDEN, 0, bias=False)
            weight = self.weight
            del self.weight
            self.register_buffer("weight", weight.detach().requires_grad_())

    class Model(nn.Module):

        def __init__(self, empty_cls):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN) for _ in range(SIZED_LAYERS)])
            self.empties = nn.ModuleList([empty_cls() for _ in range(num_empty)])

        def forward(self, x):
            for layer in self.layers:
                x = torch.relu(layer(x))
            for empty in self.empties:
                x = x + empty(x).sum()
            return x.square().mean()

    deepspeed.init_distributed()
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
    empty_classes = {"model": lambda: nn.Linear(HIDDEN, 0, bias=False)}
    if control:
        empty_classes["control"] = EmptyBuffer
    if control_first:
        empty_classes = dict(reversed(empty_classes.items()))
    engines = {}
    for name, empty_cls in empty_classes.items():
        torch.manual_seed(0)
        model = Model(empty_cls)
        engines[name], _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(BATCH, HIDDEN).to(engines["model"].device)

    def train_step(engine):
        dist.barrier()
        start = time.perf_counter()
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        dist.barrier()
        return time.perf_counter() - start

    for _ in range(3):
        for engine in engines.values():
            train_step(engine)
    # Collectives of one step of each, by operation.
    counts = {}
    for name, engine in engines.items():
        dist.reset_log()
        train_step(engine)
        counts[name] = {
            op: sum(entry[0] for entry in by_size.values())
            for op, by_size in dist.comms_logger.comms_dict.items() if op != "barrier"
        }
    dist.configure(enabled=False)
    times = {name: [] for name in engines}
    order = list(engines)
    for step in range(steps):
        # ABBA: neither engine always steps right after the other.
        for name in (order if step % 2 == 0 else order[::-1]):
            times[name].append(train_step(engines[name]))
    if dist.get_rank() == 0:
        result = {
            name: {
                "collectives": counts[name],
                "step_ms": 1000 * statistics.median(times[name])
            }
            for name in engines
        }
        print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def collective_summary(counts):
    gathers = sum(n for name, n in counts.items() if "all_gather" in name)
    reduce_scatters = sum(n for name, n in counts.items() if "reduce_scatter" in name)
    all_reduces = sum(n for name, n in counts.items() if "all_reduce" in name)
    return gathers, reduce_scatters, all_reduces


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="measured steps per run (after 3 warm-up steps)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each variant")
    parser.add_argument("--world-sizes", default="1,2", help="comma-separated world sizes")
    parser.add_argument("--num-empty", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--control", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--control-first", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--work-dir", default=str(REPO / "build" / "bench-zero-empty-params"))
    args = parser.parse_args()
    if args.worker:
        worker(args.num_empty, args.steps, args.control, args.control_first)
        return

    workdir = Path(args.work_dir)
    workdir.mkdir(parents=True, exist_ok=True)
    trees = prepare_trees(workdir / "trees")
    ext_dir = workdir / "torch-extensions"
    results = {"empty_submodules": [], "ratio_runs": []}

    print("| world size | K empty submodules | variant | all-gathers/step | reduce-scatters/step | "
          "all-reduces/step | step ms | step / control (spread) |")
    print("|---|---|---|---|---|---|---|---|")
    for world_size in map(int, args.world_sizes.split(",")):
        for num_empty in (16, 256):
            runs = {"gate-only": [], "fork": []}
            for repeat in range(args.repeats):
                control_first = repeat % 2 == 1
                for variant in runs:
                    result = run_variant(trees[variant], world_size, num_empty, args.steps, ext_dir / variant, True,
                                         control_first)
                    results["empty_submodules"].append(
                        dict(result, variant=variant, world_size=world_size, num_empty=num_empty))
                    runs[variant].append(result)
            for variant, variant_runs in runs.items():
                failed = [run["error"] for run in variant_runs if "error" in run]
                if failed:
                    print(f"| {world_size} | {num_empty} | {variant} | failed: {failed[0]!r} |")
                    continue
                ratios = [run["model"]["step_ms"] / run["control"]["step_ms"] for run in variant_runs]
                for name, label in (("model", variant), ("control", f"{variant}'s control")):
                    gathers, reduce_scatters, all_reduces = collective_summary(variant_runs[0][name]["collectives"])
                    step_ms = statistics.median(run[name]["step_ms"] for run in variant_runs)
                    ratio = (f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
                             if name == "model" else "1")
                    print(
                        f"| {world_size} | {num_empty} | {label} | {gathers} | {reduce_scatters} | {all_reduces} | "
                        f"{step_ms:.2f} | {ratio} |",
                        flush=True)

    step_ms = {"upstream": [], "fork": []}
    for _ in range(args.repeats):
        for variant in ("upstream", "fork"):
            result = run_variant(trees[variant], 2, 0, args.steps, ext_dir / variant)
            results["ratio_runs"].append(dict(result, variant=variant))
            if "error" in result:
                sys.exit(f"{variant} failed on a model without empty parameters: {result['error']}")
            step_ms[variant].append(result["model"]["step_ms"])
    ratios = [fork / upstream for fork, upstream in zip(step_ms["fork"], step_ms["upstream"])]
    fork_ms, upstream_ms = statistics.median(step_ms["fork"]), statistics.median(step_ms["upstream"])
    results["step_time_ratio_fork_over_upstream"] = fork_ms / upstream_ms
    print(f"\nK = 0, world size 2, median of {args.repeats} alternating runs of {args.steps} steps: "
          f"fork {fork_ms:.2f} ms, upstream {upstream_ms:.2f} ms, ratio fork/upstream {fork_ms / upstream_ms:.3f} "
          f"(per-pair ratios {min(ratios):.3f}-{max(ratios):.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
