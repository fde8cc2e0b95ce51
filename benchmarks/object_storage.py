# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Reading a checkpoint from S3-compatible object storage, against the storage client's own download
of the same objects from the same server.

The checkpoint folder (by default the 130.8M-parameter ZeRO-3 checkpoint of one rank that
``checkpoint_tools.py --scale medium`` creates) is uploaded once to moto's S3 API server on
127.0.0.1, started here; then, in turn in each repeat:

- ``download``: s3fs reads every object of the folder into memory (``cat_file``), the client's own
  download of the same bytes;
- ``verify``: ``ds_verify_checkpoint s3://...`` as users run it (every byte read once, its CRC-32
  computed; ``import deepspeed``, a few seconds, included);
- ``load_s3``: ``engine.load_checkpoint("s3://...")`` in a 1-rank job (checkpoint_tools.py's load
  worker: the time of ``load_checkpoint`` alone);
- ``load_local``: the same job loading the local folder.

Throughput is the folder's size over the median time. moto serves from Python on the same 2 cores as
the reader, so the ratios, not the GB/s, are what carries over to a real store.

    python benchmarks/object_storage.py --tree PATCHED_TREE --repeats 3
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from checkpoint_tools import free_port  # noqa: E402
from unit.checkpoint.s3_server import s3_environment, s3_server, upload_folder  # noqa: E402


def folder_bytes(folder):
    return sum(path.stat().st_size for path in Path(folder).rglob("*") if path.is_file())


def load_seconds(tree, kind, scale, save_dir, environment):
    """``load_checkpoint`` of ``save_dir`` in a 1-rank job of checkpoint_tools.py: its wall time."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(REPO / "benchmarks" / "checkpoint_tools.py"), "--load", kind, "--scale", scale, "--save-dir", save_dir
    ]
    env = dict(os.environ, **environment, PYTHONPATH=str(tree))
    proc = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        raise RuntimeError(f"the load job failed:\n{proc.stdout[-3000:]}")
    return results[-1]["load_s"]


def verify_seconds(tree, url, environment):
    """``ds_verify_checkpoint url`` as users run it (a process of its own: a process does not verify a
    file twice): its wall time, ``import deepspeed`` included."""
    env = dict(os.environ, **environment, PYTHONPATH=str(tree))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.verify_checkpoint", url],
                          env=env,
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT,
                          text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"ds_verify_checkpoint failed:\n{proc.stdout[-3000:]}")
    return elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", required=True, help="a patched tree of the fork (python -m forktools tree)")
    parser.add_argument("--checkpoint",
                        default=str(REPO / "build" / "bench-checkpoint-tools" / "checkpoints" / "medium" /
                                    "zero3-ws1"),
                        help="a checkpoint folder of checkpoint_tools.py (--kind and --scale name its model)")
    parser.add_argument("--kind", default="zero3-ws1")
    parser.add_argument("--scale", default="medium")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import s3fs

    size = folder_bytes(args.checkpoint)
    times = {"download": [], "verify": [], "load_s3": [], "load_local": []}
    with s3_server() as endpoint, s3_environment(endpoint) as environment:
        fs = s3fs.S3FileSystem()
        fs.mkdir("bench")
        url = "s3://bench/checkpoint"
        start = time.perf_counter()
        upload_folder(args.checkpoint, url)
        print(f"upload (s3fs put_file): {time.perf_counter() - start:.2f} s for {size / 1e9:.2f} GB", flush=True)
        objects = fs.find(url)
        for repeat in range(args.repeats):
            start = time.perf_counter()
            for path in objects:
                fs.cat_file(path)
            times["download"].append(time.perf_counter() - start)
            times["verify"].append(verify_seconds(args.tree, url, environment))
            times["load_s3"].append(load_seconds(args.tree, args.kind, args.scale, url, environment))
            times["load_local"].append(load_seconds(args.tree, args.kind, args.scale, args.checkpoint, environment))
            print(f"repeat {repeat + 1}: " + ", ".join(f"{name} {runs[-1]:.2f} s" for name, runs in times.items()),
                  flush=True)

    download = statistics.median(times["download"])
    print(f"\n{size / 1e9:.2f} GB in {len(objects)} objects, {args.repeats} repeats\n")
    print("| read | s, median (runs) | GB/s | throughput / the client's download |")
    print("|---|---|---|---|")
    for name, runs in times.items():
        median = statistics.median(runs)
        print(f"| {name} | {median:.2f} ({', '.join(f'{run:.1f}' for run in runs)}) | {size / 1e9 / median:.3f} | "
              f"{download / median:.2f} |")


if __name__ == "__main__":
    main()
