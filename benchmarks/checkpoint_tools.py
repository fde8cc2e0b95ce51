# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Offline checkpoint tools: time, peak memory and peak extra disk of zero_to_fp32 and ds_to_universal.

One run measures, on checkpoints it synthesizes itself (real ``save_checkpoint`` after one Adam step
in fp32, gloo on CPU, saved by unpatched upstream 0.19.8 unless ``--save-with fork``):

* ``autotp-z1``, ``autotp-z3``: a ``transformers`` LlamaForCausalLM built from a config, AutoTP
  tp2 x dp2 (world size 4), ZeRO stage 1 and 3 (254M parameters at ``--scale full``);
* ``zero3``: the same kind of Llama, plain ZeRO-3 at world size 2, built under ``zero.Init``
  (569M parameters at ``--scale full``); ``zero3-ws1`` (only with ``--checkpoints``): the same
  at world size 1, the baseline of a job on one rank; ``zero2`` (only with ``--checkpoints``): the
  same model at ZeRO-2, world size 2, the baseline of a ZeRO-2 job;

and on each, for the variants ``upstream`` (0.19.8) and ``fork`` (and, with ``--variants``,
``fork-trusting``: the fork with its weights_only check off, ``--no_weights_only`` or
``"checkpoint": {"weights_only": false}``, which loads as the fork did before the check; and
``fork-no-fsync``: the fork without flushing what it writes to disk, ``--no_fsync`` or
``"checkpoint": {"fsync": false}``; ``fork-unverified``: the fork without verifying the CRC-32s of
the files it reads, ``--no_verify_crc32`` or ``"checkpoint": {"verify_crc32": false}``), as a user
runs them:

* ``zero_to_fp32``: ``python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR`` with the script of the
  variant (the one it saves into every checkpoint) and its default options;
* ``ds_to_universal``: ``python -m deepspeed.checkpoint.ds_to_universal --input_folder TAG_DIR
  --output_folder OUTPUT_DIR``, first without options; if the variant refuses for want of
  ``--inject_missing_state``, again with it (the table says which runs needed it);
* ``load_checkpoint`` (``--tools load_checkpoint``): a training job of the checkpoint's topology
  (same world size, model built as when it was saved) that resumes from it with
  ``engine.load_checkpoint(dir)``; the time is that of ``load_checkpoint`` alone (slowest rank),
  the memory that of the whole job;
* ``load_resharded`` (``--tools load_resharded``): the same, in a job of another data-parallel size
  (world size 1 for ``zero3``, 2 for ``zero3-ws1`` and the tp2 x dp2 checkpoints), which the fork
  loads straight from the rank files and upstream refuses;
* ``load_other_stage`` (``--tools load_other_stage``): the same, in a job of the checkpoint's world
  size at another ZeRO stage (ZeRO-2 for the ZeRO-3 checkpoints, ZeRO-3 for the ZeRO-1 one), which
  the fork loads straight from the rank files and upstream refuses;
* ``load_universal`` (``--tools load_universal``): the same job, loading the checkpoint converted
  by the fork's ``ds_to_universal`` (converted once, untimed) with ``"checkpoint":
  {"load_universal": true}``: with the ``ds_to_universal`` row, the offline path;
* ``save_checkpoint`` (``--tools save_checkpoint``): a training job of the checkpoint's topology
  that trains one step and saves with ``engine.save_checkpoint(OUTPUT_DIR)``; the time is that of
  ``save_checkpoint`` alone (slowest rank);
* ``save_and_train`` (``--tools save_and_train``): a training job of the checkpoint's topology
  that trains one step, times ``STEPS`` steps, saves, and times ``STEPS`` steps again: how long
  ``save_checkpoint`` blocks (``save_s``), how much longer the steps after it take than those
  before (``steps_slower_s``), how long ``wait_for_async_save()`` then waits for a background save
  (``drain_s``), and their sum, what the save costs the run (``cost_s``; slowest rank each);
* ``ds_verify_checkpoint`` (``--tools ds_verify_checkpoint``, the fork only): ``python -m
  deepspeed.checkpoint.verify_checkpoint CHECKPOINT_DIR``, which checks every file of every tag
  and the CRC-32 of every record;
* ``cp -r`` of the checkpoint folder, the floor; and ``python -c 'import deepspeed'`` alone, what
  every run of a tool pays before it reads a byte.

Per run: wall time of the command (process start to exit, interpreter start and imports included);
peak RSS of its largest process (``getrusage(RUSAGE_CHILDREN).ru_maxrss`` in a wrapper process)
and the peak proportional set size of the whole process tree (PSS summed over the tool and its
worker processes, sampled every 50 ms; unlike summed RSS it counts pages the workers share once),
and in brackets that of its anonymous memory alone (without the pages of memory-mapped checkpoint
files, which are page cache the kernel reclaims when memory runs short);
peak extra disk (allocated blocks under a fresh scratch folder that holds the output folder and
is the tool's TMPDIR, sampled every 50 ms; any temp folder a tool makes in or beside its output
is counted); and the size of the output. The numbers are the medians of ``--repeats`` runs; the
variants alternate within each repeat.

Page cache: warm. Before every timed run the checkpoint is read once in full (untimed), and the
share of its pages resident in the page cache at that moment is recorded (``fincore``); after
every run the output is deleted and ``sync`` runs (untimed), so no run pays for the writeback of
the one before.

The variants are built from the pinned upstream sdist and this repository's patch series
(nothing is installed); each runs from its source tree via PYTHONPATH. ``--fork-tree PATH`` runs
the fork variant from an existing tree instead (e.g. a patch-queue worktree), and ``--fork-tree
TOOL=PATH`` does so for one tool only (TOOL is zero_to_fp32 or ds_to_universal); such a tree is
copied at the start, so edits made while the repeats run do not mix in. Usage, from the
repository root:

    python benchmarks/checkpoint_tools.py [--scale small|full] [--repeats 3] [--json results.json]

The checkpoints are cached under ``build/bench-checkpoint-tools/checkpoints`` (15 GB at ``--scale
full``, created in about 5 minutes; the ZeRO-3 one peaks at 10 GB of memory per rank, 20 GB in
all); the runs need up to 18 GB more disk (upstream ds_to_universal's temp folder and output).
At full scale with 3 repeats a run takes about 35 minutes on 2 cores. Needs torch,
transformers and the fork's test requirements; set DS_FORK_SDIST to use a local copy of the sdist.
"""

import argparse
import json
import os
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOOLS = ("zero_to_fp32", "ds_to_universal", "load_checkpoint", "load_resharded", "load_other_stage", "load_universal",
         "save_checkpoint", "save_and_train", "ds_verify_checkpoint")
SAVE_TOOLS = ("save_checkpoint", "save_and_train")
LOAD_TOOLS = ("load_checkpoint", "load_resharded", "load_other_stage", "load_universal")
# fork-trusting: the fork with its weights_only check off (``--no_weights_only``,
# ``"checkpoint": {"weights_only": false}``), which loads as the fork did before the check.
# fork-no-fsync: the fork without its fsync()s (``--no_fsync``, ``"checkpoint": {"fsync": false}``).
# fork-unverified: the fork without its CRC-32 check (``--no_verify_crc32``, ``"checkpoint": {"verify_crc32": false}``).
# fork-async: save_checkpoint in the background (``"checkpoint": {"async_save": true}``).
# fork-async-overlap: the same, and the steps do not wait for it (``"async_save_wait": "save"``).
# fork-base: the fork from the tree ``--base-tree`` names (the series before a change), beside ``fork``.
VARIANTS = ("upstream", "fork", "fork-trusting", "fork-no-fsync", "fork-unverified", "fork-async", "fork-async-overlap",
            "fork-base")
VARIANT_FLAGS = {
    "fork-trusting": ["--no_weights_only"],
    "fork-no-fsync": ["--no_fsync"],
    "fork-unverified": ["--no_verify_crc32"],
    "fork-async": ["--async_save"],
    "fork-async-overlap": ["--async_save", "--async_save_wait", "save"]
}
DEFAULT_VARIANTS = ("upstream", "fork")
SEQ_LEN = 16
SAMPLE_S = 0.05
# The model of each checkpoint kind, by scale: LlamaConfig arguments.
LLAMA = {
    "small": {
        "autotp": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, vocab_size=4096),
        "zero3": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, vocab_size=4096),
    },
    # A checkpoint that the page cache holds beside the loading job on a 24 GB machine.
    "medium": {
        "autotp": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=6, vocab_size=16000),
        "zero3": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, vocab_size=16000),
    },
    "full": {
        "autotp": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=12, vocab_size=32000),
        "zero3": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=32, vocab_size=32000),
    },
}
# name: (model, ZeRO stage, world size, tensor-parallel size)
CHECKPOINTS = {
    "autotp-z1": ("autotp", 1, 4, 2),
    "autotp-z3": ("autotp", 3, 4, 2),
    "zero3": ("zero3", 3, 2, 1),
    "zero3-ws1": ("zero3", 3, 1, 1),
    "zero2": ("zero3", 2, 2, 1),
}
DEFAULT_CHECKPOINTS = ("autotp-z1", "autotp-z3", "zero3")
INJECT_HINTS = ("--inject_missing_state", "Required universal_checkpoint_info state is missing")


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gb(nbytes):
    return nbytes / 1e9


# ---------------------------------------------------------------------------------------------
# Variants


def prepare_trees(workdir):
    """Source trees of unpatched upstream and of the fork (the whole series), under ``workdir``."""
    sys.path.insert(0, str(REPO))
    from forktools.series import read_series
    from forktools.upstream import pinned_release

    release = pinned_release(REPO, workdir)
    trees = {}
    for variant, patches in (("upstream", []), ("fork", read_series(REPO))):
        # Always from the pristine sdist: a tree left by an earlier run may hold an older series.
        shutil.rmtree(workdir / variant, ignore_errors=True)
        trees[variant] = release.tree(workdir / variant, patches)
    return trees


def parse_fork_trees(values):
    """``--fork-tree PATH`` (both tools) and ``--fork-tree TOOL=PATH`` -> {tool: Path}."""
    chosen = {}
    for value in values or []:
        tool, sep, path = value.partition("=")
        if not sep:
            tool, path = None, value
        elif tool not in TOOLS:
            sys.exit(f"--fork-tree {value}: the tool must be one of {', '.join(TOOLS)}")
        path = Path(path).resolve()
        if not (path / "deepspeed" / "__init__.py").is_file():
            sys.exit(f"--fork-tree {value}: {path} holds no deepspeed package")
        for name in ([tool] if tool else TOOLS):
            chosen[name] = path
    return chosen


def tree_description(tree):
    """The tree and, for a git tree, its commit (a helper's queue tree changes while it works)."""
    proc = subprocess.run(["git", "-C", str(tree), "log", "-1", "--format=%h %s"],
                          stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL,
                          text=True)
    head = proc.stdout.strip() if proc.returncode == 0 else ""
    if head:
        dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                               stdout=subprocess.PIPE,
                               text=True).stdout.strip()
        head += " (+ uncommitted changes)" if dirty else ""
    return f"{tree}" + (f" at {head}" if head else "")


# ---------------------------------------------------------------------------------------------
# Checkpoints


def llama_config(model, scale):
    from transformers import LlamaConfig
    return LlamaConfig(num_attention_heads=16 if scale == "full" else 8,
                       num_key_value_heads=8 if scale == "full" else 4,
                       max_position_embeddings=2 * SEQ_LEN,
                       tie_word_embeddings=False,
                       **LLAMA[scale][model])


def log_memory(phase):
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    print(f"rank {os.environ.get('RANK')}: {phase}: RSS {fields['VmRSS'].strip()}, peak {fields['VmHWM'].strip()}",
          flush=True)


def reshard_world_size(kind):
    """The world size of ``load_resharded``: half the data-parallel ranks, or twice one."""
    _, _, world_size, tp_size = CHECKPOINTS[kind]
    return world_size // 2 if world_size // tp_size > 1 else world_size * 2


def other_zero_stage(kind):
    """The ZeRO stage of ``load_other_stage``: 2 for a ZeRO-3 checkpoint, 3 for the others."""
    return 2 if CHECKPOINTS[kind][1] == 3 else 3


def build_engine(kind, scale, checkpoint_config=None, world_size=None, stage=None):
    """One rank's engine of the checkpoint ``kind``'s model (at its world size and ZeRO stage unless
    ``world_size``, ``stage``); returns it with its number of parameters."""
    import torch
    import deepspeed
    import deepspeed.comm as dist
    from transformers import LlamaForCausalLM

    model_name, saved_stage, saved_world_size, tp_size = CHECKPOINTS[kind]
    world_size = world_size or saved_world_size
    stage = stage or saved_stage
    deepspeed.init_distributed()
    assert dist.get_world_size() == world_size, f"{kind} needs world size {world_size}"
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-4,
                "torch_adam": True
            }
        },
        "zero_optimization": {
            "stage": stage,
            # The defaults (5e8 elements for the reduce bucket, 1e9 live parameters) would hold up to
            # 6 GB more per rank than the optimizer states of the largest checkpoint.
            "reduce_bucket_size": 5e7,
            "allgather_bucket_size": 5e7,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_max_live_parameters": 1e8,
            "stage3_max_reuse_distance": 1e8,
        },
    }
    if tp_size > 1:
        config["tensor_parallel"] = {"autotp_size": tp_size}
    if checkpoint_config:
        config["checkpoint"] = checkpoint_config
    torch.manual_seed(1234)
    llama = llama_config(model_name, scale)
    if tp_size == 1 and stage == 3:
        # Partitioned as it is built: the full model never exists on one rank.
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = LlamaForCausalLM(llama)
        num_params = sum(p.ds_numel for p in model.parameters())
    else:
        model = LlamaForCausalLM(llama)
        num_params = sum(p.numel() for p in model.parameters())
    log_memory("model built")
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    log_memory("engine initialized")
    return engine, num_params


def create_worker(kind, scale, save_dir):
    """One rank of the run that trains one step and saves the checkpoint ``kind``."""
    import torch
    import deepspeed.comm as dist

    engine, num_params = build_engine(kind, scale)
    tp_size = CHECKPOINTS[kind][3]
    generator = torch.Generator().manual_seed(dist.get_rank() // tp_size)
    ids = torch.randint(0, engine.module.config.vocab_size, (1, SEQ_LEN), generator=generator).to(engine.device)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    log_memory("one step")
    engine.save_checkpoint(save_dir, tag="step1")
    log_memory("saved")
    dist.barrier()
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"num_params": num_params}), flush=True)
    dist.destroy_process_group()


def load_worker(kind,
                scale,
                save_dir,
                weights_only,
                world_size=None,
                load_universal=False,
                verify_crc32=True,
                stage=None):
    """One rank of a training job that resumes from the checkpoint ``kind`` (at its world size and
    ZeRO stage unless ``world_size``, ``stage``); prints the wall time of ``load_checkpoint`` alone,
    the slowest rank's."""
    checkpoint_config = {}
    if not weights_only:
        checkpoint_config["weights_only"] = False
    if not verify_crc32:
        checkpoint_config["verify_crc32"] = False
    if load_universal:
        checkpoint_config["load_universal"] = True
    engine, _ = build_engine(kind, scale, checkpoint_config, world_size, stage)
    report_slowest("load_s", "loaded", lambda: engine.load_checkpoint(save_dir))


def report_slowest(key, phase, call):
    """Run ``call`` on every rank between two barriers; rank 0 prints its wall time (the slowest
    rank's) as ``key``. Ends the job."""
    import deepspeed.comm as dist

    dist.barrier()
    start = time.perf_counter()
    call()
    dist.barrier()
    elapsed = time.perf_counter() - start
    log_memory(phase)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({key: elapsed}), flush=True)
    dist.destroy_process_group()


def save_worker(kind, scale, save_dir, fsync, async_save=False):
    """One rank of a training job that trains one step and saves (topology of the checkpoint ``kind``);
    prints the wall time of ``save_checkpoint`` alone, the slowest rank's (``save_s``), then saves the
    same tag again, as Lightning saves its "checkpoint", and prints that time too (``resave_s``). With
    ``async_save`` it saves
    twice and times both saves: how long the call blocks (``save_s``), and until `latest` names the tag
    (``durable_s``: the call and the background writes); the second save reuses the first one's host
    buffers, as every save of a run after its first does. No step runs between the saves: one would
    need the memory of a step beside the host copy, more than this machine's 24 GB at world size 2."""
    import deepspeed.comm as dist

    engine, train_step = saving_job(kind, scale, fsync, async_save)
    train_step()
    times = {}
    if not async_save:
        for key in ("save_s", "resave_s"):
            times[key] = timed(lambda: engine.save_checkpoint(save_dir, tag="step1"))
        report_slowest_times(times, "saved")
        return
    for tag in ("step1", "step2"):
        dist.barrier()
        start = time.perf_counter()
        engine.save_checkpoint(save_dir, tag=tag)
        blocked = time.perf_counter() - start
        engine.wait_for_async_save()
        times[tag] = (blocked, time.perf_counter() - start)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, times)
    log_memory("saved")
    if dist.get_rank() == 0:
        slowest = {f"{key}_{tag}": max(rank_times[tag][index] for rank_times in gathered)
                   for tag in ("step2", "step1") for index, key in enumerate(("save_s", "durable_s"))}
        print("RESULT " + json.dumps(slowest), flush=True)
    dist.destroy_process_group()


STEPS = 3


def saving_job(kind, scale, fsync, async_save, async_save_wait=None):
    """One rank's engine of a training job of the checkpoint ``kind``'s topology that saves with these
    settings, and a function that trains it one step."""
    import torch
    import deepspeed.comm as dist

    checkpoint_config = {}
    if not fsync:
        checkpoint_config["fsync"] = False
    if async_save:
        checkpoint_config["async_save"] = True
    if async_save_wait:
        checkpoint_config["async_save_wait"] = async_save_wait
    engine, _ = build_engine(kind, scale, checkpoint_config or None)
    generator = torch.Generator().manual_seed(dist.get_rank() // CHECKPOINTS[kind][3])
    ids = torch.randint(0, engine.module.config.vocab_size, (1, SEQ_LEN), generator=generator).to(engine.device)

    def train_step():
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()

    return engine, train_step


def timed(call):
    """The wall time of ``call()`` on this rank, from a barrier of every rank."""
    import deepspeed.comm as dist

    dist.barrier()
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def report_slowest_times(times, phase):
    """Rank 0 prints the slowest rank's of each of ``times`` (``{key: seconds}``). Ends the job."""
    import deepspeed.comm as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, times)
    log_memory(phase)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({key: max(rank_times[key] for rank_times in gathered)
                                      for key in times}),
              flush=True)
    dist.destroy_process_group()


def save_and_train_worker(kind, scale, save_dir, fsync, async_save=False, async_save_wait=None):
    """One rank of a training job that trains one step, then ``STEPS`` steps (timed), saves (timed),
    and trains ``STEPS`` steps again (timed); prints the times of the module docstring's
    ``save_and_train``, the slowest rank's, and the time of one step (``step_s``)."""
    engine, train_step = saving_job(kind, scale, fsync, async_save, async_save_wait)

    def train_steps():
        for _ in range(STEPS):
            train_step()

    train_step()
    steps_before = timed(train_steps)
    save = timed(lambda: engine.save_checkpoint(save_dir, tag="step"))
    steps_after = timed(train_steps)
    # 0.19.8 has no background save to wait for.
    drain = timed(getattr(engine, "wait_for_async_save", lambda: None))
    report_slowest_times(
        {
            "cost_s": save + steps_after - steps_before + drain,
            "save_s": save,
            "steps_slower_s": steps_after - steps_before,
            "drain_s": drain,
            "step_s": steps_before / STEPS,
        }, "saved")


def du(path):
    """Allocated bytes under ``path`` (files that vanish while it walks are skipped)."""
    total = 0
    stack = [str(path)]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                else:
                    total += entry.stat(follow_symlinks=False).st_blocks * 512
            except OSError:
                pass
    return total


def ensure_checkpoint(kind, scale, workdir, save_tree, save_variant, ext_dir):
    """The cached checkpoint ``kind``, created on first use; returns its metadata."""
    model_name, stage, world_size, tp_size = CHECKPOINTS[kind]
    base = workdir / "checkpoints" / scale
    save_dir, meta_file = base / kind, base / f"{kind}.json"
    recipe = {
        "kind": kind,
        "llama": LLAMA[scale][model_name],
        "stage": stage,
        "world_size": world_size,
        "tp_size": tp_size,
        "saved_by": save_variant,
        "seq_len": SEQ_LEN
    }
    if meta_file.is_file():
        meta = json.loads(meta_file.read_text())
        if meta.get("recipe") == recipe and save_dir.is_dir():
            return meta
    shutil.rmtree(save_dir, ignore_errors=True)
    meta_file.unlink(missing_ok=True)
    base.mkdir(parents=True, exist_ok=True)
    print(f"creating the {scale} checkpoint {kind} (saved by {save_variant}) ...", flush=True)
    env = dict(os.environ, PYTHONPATH=str(save_tree), TORCH_EXTENSIONS_DIR=str(ext_dir / save_variant))
    # Allocations of 128 KiB and more come from mmap and go back to the system when freed: glibc's
    # heap would keep the transient copies of ZeRO-3's initialization (parameter partitions,
    # flattening) resident, about twice the memory the run needs.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
        str(world_size), "--master_port",
        str(free_port()), __file__, "--create", kind, "--scale", scale, "--save-dir",
        str(save_dir)
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
    (base / f"{kind}.log").write_text(proc.stdout)
    if proc.returncode != 0 or result is None:
        errors = [line for line in proc.stdout.splitlines() if re.search(r"(Error|Exception)\b", line)]
        sys.exit(f"creating the checkpoint {kind} failed (log: {base / f'{kind}.log'}):\n" + "\n".join(errors[-10:]))
    meta = dict(recipe=recipe,
                num_params=result["num_params"],
                bytes=du(save_dir),
                files=sum(len(files) for _, _, files in os.walk(save_dir)),
                create_s=time.perf_counter() - start)
    meta_file.write_text(json.dumps(meta, indent=2))
    print(f"  {meta['num_params'] / 1e6:.1f}M parameters, {gb(meta['bytes']):.2f} GB, "
          f"{meta['create_s']:.0f} s",
          flush=True)
    return meta


def warm(save_dir):
    """Read every file of the checkpoint once; return the share of its pages then in the page cache."""
    paths = [Path(root) / name for root, _, files in os.walk(save_dir) for name in files]
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(1 << 24):
                pass
    if not shutil.which("fincore"):
        return None
    proc = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES,SIZE"] +
                          [str(p) for p in paths],
                          stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL,
                          text=True)
    resident = size = 0
    for line in proc.stdout.splitlines():
        fields = line.split()
        if len(fields) == 2:
            resident += int(fields[0])
            size += int(fields[1])
    return resident / size if size else None


# ---------------------------------------------------------------------------------------------
# Measuring one command


def process_tree(root_pid):
    """Pids of ``root_pid`` and all its descendants (from /proc)."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    tree, stack = [], [root_pid]
    while stack:
        pid = stack.pop()
        tree.append(pid)
        stack.extend(children.get(pid, []))
    return tree


def pss_bytes(pid):
    """The proportional set size of ``pid``, all of it and its anonymous memory alone (without the
    pages of memory-mapped files, which the kernel reclaims when memory runs short)."""
    pss = {"Pss:": 0, "Pss_Anon:": 0}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.split()[0] in pss:
                    pss[line.split()[0]] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return pss["Pss:"], pss["Pss_Anon:"]


# Set by --no-pss for the measuring wrapper: reading a process's smaps_rollup takes the lock that its
# page faults take, so sampling PSS slows a job that copies a checkpoint out of a memory map.
NO_PSS_ENV = "CHECKPOINT_TOOLS_NO_PSS"


def measure(cmd, scratch, log_file):
    """Run ``cmd`` (the --measure wrapper side): time, peak tree PSS, peak disk under ``scratch``."""
    env = dict(os.environ, TMPDIR=str(scratch))
    peak = {"pss": 0, "pss_anon": 0, "disk": 0}
    statvfs = os.statvfs(scratch)
    free_before = statvfs.f_bavail * statvfs.f_frsize
    min_free = free_before
    done = threading.Event()
    sample_pss = not os.environ.get(NO_PSS_ENV)

    def sample(pid):
        nonlocal min_free
        while not done.is_set():
            tree = [pss_bytes(p) for p in process_tree(pid)] if sample_pss else []
            peak["pss"] = max(peak["pss"], sum(pss for pss, _ in tree))
            peak["pss_anon"] = max(peak["pss_anon"], sum(anon for _, anon in tree))
            peak["disk"] = max(peak["disk"], du(scratch))
            st = os.statvfs(scratch)
            min_free = min(min_free, st.f_bavail * st.f_frsize)
            done.wait(SAMPLE_S)

    with open(log_file, "w") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        sampler = threading.Thread(target=sample, args=(proc.pid, ), daemon=True)
        sampler.start()
        returncode = proc.wait()
        elapsed = time.perf_counter() - start
        done.set()
        sampler.join()
    peak["disk"] = max(peak["disk"], du(scratch))
    return {
        "returncode": returncode,
        "seconds": elapsed,
        "maxrss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
        "peak_pss": peak["pss"],
        "peak_pss_anon": peak["pss_anon"],
        "peak_disk": peak["disk"],
        "df_delta": free_before - min_free,
    }


def run_measured(cmd, env, scratch, log_file):
    """Run ``cmd`` under the wrapper (its own process, so RUSAGE_CHILDREN covers this command only)."""
    wrapper = [sys.executable, __file__, "--measure", "--scratch", str(scratch), "--log", str(log_file), "--"]
    proc = subprocess.run(wrapper + cmd, env=env, cwd=scratch, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("MEASURE "):
            return json.loads(line[len("MEASURE "):])
    sys.exit(f"the measuring wrapper failed on {' '.join(cmd)}: {proc.stdout[-2000:]}")


def error_line(log_file):
    """The exception line of a failed run (the last ``SomethingError: ...`` line), or its last line."""
    lines = [line.strip() for line in Path(log_file).read_text(errors="replace").splitlines() if line.strip()]
    for line in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Exit)\b", line):
            return line[:200]
    return (lines[-1] if lines else "no output")[:200]


def tool_command(tool, script, checkpoint_dir, output_dir, inject, flags=()):
    if tool == "import deepspeed":
        return [sys.executable, "-c", "import deepspeed"]
    if tool == "cp -r":
        return ["cp", "-r", str(checkpoint_dir), str(output_dir)]
    if tool == "cp -r + sync":
        # The offline tools flush what they write; cp does not.
        return ["sh", "-c", 'cp -r "$0" "$1" && sync', str(checkpoint_dir), str(output_dir)]
    if tool == "ds_verify_checkpoint":
        return [sys.executable, "-m", "deepspeed.checkpoint.verify_checkpoint", str(checkpoint_dir)] + list(flags)
    flags = list(flags)
    if tool == "zero_to_fp32":
        return [sys.executable, str(script), str(checkpoint_dir), str(output_dir)] + flags
    if tool in LOAD_TOOLS or tool in SAVE_TOOLS:
        kind, scale = checkpoint_dir.name, checkpoint_dir.parent.name
        world_size = CHECKPOINTS[kind][2]
        job = ["--load", kind, "--save-dir", str(checkpoint_dir)]
        if tool in SAVE_TOOLS:
            job = ["--save" if tool == "save_checkpoint" else "--save-and-train", kind, "--save-dir", str(output_dir)]
        if tool in ("load_resharded", "load_universal"):
            world_size = reshard_world_size(kind)
            job += ["--load-world-size", str(world_size)]
        if tool == "load_other_stage":
            job += ["--load-stage", str(other_zero_stage(kind))]
        if tool == "load_universal":
            job = ["--load", kind, "--save-dir", str(universal_dir(checkpoint_dir)), "--load-universal"] + job[4:]
        return [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
            str(world_size), "--master_port",
            str(free_port()), __file__, "--scale", scale
        ] + job + flags
    tag_dir = checkpoint_dir / (checkpoint_dir / "latest").read_text().strip()
    cmd = [
        sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
        str(tag_dir), "--output_folder",
        str(output_dir)
    ]
    return cmd + (["--inject_missing_state"] if inject else []) + flags


def universal_dir(checkpoint_dir):
    """Where ``load_universal`` finds the fork's conversion of a checkpoint (``latest_universal`` in it)."""
    return checkpoint_dir.parents[2] / "universal" / checkpoint_dir.parent.name / checkpoint_dir.name


def ensure_universal(checkpoint_dir, tree, ext_dir):
    """Convert the checkpoint with the fork's ds_to_universal, once, untimed."""
    folder = universal_dir(checkpoint_dir)
    if (folder / "latest_universal").is_file():
        return
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    print(f"converting {checkpoint_dir.name} for load_universal ...", flush=True)
    tag_dir = checkpoint_dir / (checkpoint_dir / "latest").read_text().strip()
    subprocess.run([
        sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
        str(tag_dir), "--output_folder",
        str(folder / f"{tag_dir.name}_universal")
    ],
                   env=dict(os.environ, PYTHONPATH=str(tree), TORCH_EXTENSIONS_DIR=str(ext_dir / "fork")),
                   check=True,
                   stdout=subprocess.DEVNULL)
    for name in os.listdir(checkpoint_dir):
        # The Trainer's and the engine's other files beside the tags (zero_to_fp32.py, latest).
        if (checkpoint_dir / name).is_file() and name != "latest_universal":
            shutil.copy2(checkpoint_dir / name, folder / name)


def run_tool(tool, variant, tree, checkpoint_dir, runs_dir, ext_dir, inject, repeat):
    """One timed run; returns the measurement (``error`` set if the tool failed)."""
    scratch = runs_dir / "scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    prefix = checkpoint_dir.name if checkpoint_dir else "none"
    log_file = runs_dir / f"{prefix}-{tool.replace(' ', '')}-{variant}-{repeat}.log"
    build = variant.split("-")[0]
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext_dir / build))
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    output_dir = scratch / "out"
    script = None
    if tool == "zero_to_fp32":
        # The copy that save_checkpoint writes next to the tag folders, run as users run it (from its
        # own folder: run in place, deepspeed/utils would shadow the standard library's ``types``).
        script = runs_dir / "scripts" / build / "zero_to_fp32.py"
        script.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(tree / "deepspeed" / "utils" / "zero_to_fp32.py", script)
    if tool in LOAD_TOOLS or tool in SAVE_TOOLS:
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))  # as when the checkpoint was created
    cmd = tool_command(tool, script, checkpoint_dir, output_dir, inject, VARIANT_FLAGS.get(variant, ()))
    result = run_measured(cmd, env, scratch, log_file)
    for line in Path(log_file).read_text(errors="replace").splitlines():
        if line.startswith("RESULT ") and (tool in LOAD_TOOLS or tool in SAVE_TOOLS):
            # The time of the call alone; the job's (engine initialization included) is kept.
            result["job_seconds"] = result["seconds"]
            reported = json.loads(line[len("RESULT "):])
            result["seconds"] = next(iter(reported.values()))
            result.update(reported)
    result["output_bytes"] = du(output_dir)
    result["inject_missing_state"] = inject
    result["log"] = str(log_file)
    if result["returncode"] != 0:
        result["error"] = error_line(log_file).replace(str(checkpoint_dir), "CHECKPOINT")
    shutil.rmtree(scratch, ignore_errors=True)
    os.sync()
    return result


# ---------------------------------------------------------------------------------------------
# Main


def median_of(runs, key):
    return statistics.median(run[key] for run in runs)


def summarize(runs):
    ok = [run for run in runs if "error" not in run]
    if not ok:
        return {
            "error": runs[0]["error"],
            "returncode": runs[0]["returncode"],
            "inject_missing_state": runs[0]["inject_missing_state"]
        }
    return {
        "runs": len(ok),
        "seconds": median_of(ok, "seconds"),
        "seconds_all": [run["seconds"] for run in ok],
        "maxrss": median_of(ok, "maxrss"),
        "peak_pss": median_of(ok, "peak_pss"),
        "peak_pss_anon": median_of(ok, "peak_pss_anon"),
        "peak_disk": median_of(ok, "peak_disk"),
        "output_bytes": median_of(ok, "output_bytes"),
        "inject_missing_state": ok[0]["inject_missing_state"],
    }


def table_row(kind, meta, tool, variant, summary, cp_seconds):
    label = tool if tool.startswith("cp -r") else f"`{tool}`"
    if tool == "ds_to_universal" and summary.get("inject_missing_state"):
        label += " `--inject_missing_state`"
    head = f"| {kind} | {label} | {variant} |"
    if "error" in summary:
        return f"{head} exits with {summary['returncode']}: `{summary['error']}` | | | | | |"
    spread = ", ".join(f"{s:.1f}" for s in summary["seconds_all"])
    return (f"{head} {summary['seconds']:.2f} ({spread}) | {summary['seconds'] / cp_seconds:.1f}x | "
            f"{gb(summary['maxrss']):.2f} | {gb(summary['peak_pss']):.2f} ({gb(summary['peak_pss_anon']):.2f}) | "
            f"{gb(summary['peak_disk']):.2f} | "
            f"{gb(summary['output_bytes']):.2f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=sorted(LLAMA), default="full", help="model sizes (small: to try it out)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each tool and variant (median)")
    parser.add_argument("--checkpoints",
                        default=",".join(DEFAULT_CHECKPOINTS),
                        help=f"comma-separated subset of {', '.join(CHECKPOINTS)}")
    parser.add_argument("--tools",
                        default="zero_to_fp32,ds_to_universal",
                        help=f"comma-separated subset of {', '.join(TOOLS)}")
    parser.add_argument("--variants",
                        default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated subset of {', '.join(VARIANTS)}, measured in turn in each repeat")
    parser.add_argument("--fork-tree",
                        action="append",
                        metavar="[TOOL=]PATH",
                        help="run the fork variant from this source tree instead of building it from patches/ "
                        "(repeatable; TOOL= limits it to zero_to_fp32 or ds_to_universal)")
    parser.add_argument("--base-tree",
                        metavar="PATH",
                        help="the source tree of the fork-base variant, e.g. a patch-queue worktree at the commit "
                        "before a change, to measure the change's cost beside the fork")
    parser.add_argument("--save-with",
                        choices=DEFAULT_VARIANTS,
                        default="upstream",
                        help="the variant that saves the checkpoints (default: unpatched upstream, what "
                        "users' checkpoints are)")
    parser.add_argument("--create-only",
                        action="store_true",
                        help="create (or check) the checkpoints, measure nothing")
    parser.add_argument("--no-pss",
                        action="store_true",
                        help="do not sample PSS (the tables show 0): sampling it slows loads through a memory map")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--work-dir", default=str(REPO / "build" / "bench-checkpoint-tools"))
    parser.add_argument("--create", choices=sorted(CHECKPOINTS), help=argparse.SUPPRESS)
    parser.add_argument("--load", choices=sorted(CHECKPOINTS), help=argparse.SUPPRESS)
    parser.add_argument("--save", choices=sorted(CHECKPOINTS), help=argparse.SUPPRESS)
    parser.add_argument("--save-and-train", choices=sorted(CHECKPOINTS), help=argparse.SUPPRESS)
    parser.add_argument("--async_save_wait", help=argparse.SUPPRESS)
    parser.add_argument("--no_weights_only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no_fsync", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no_verify_crc32", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--async_save", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--save-dir", help=argparse.SUPPRESS)
    parser.add_argument("--load-world-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--load-universal", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--load-stage", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    parser.add_argument("--log", help=argparse.SUPPRESS)
    parser.add_argument("command", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.no_pss:
        os.environ[NO_PSS_ENV] = "1"
    if args.create:
        create_worker(args.create, args.scale, args.save_dir)
        return
    if args.load:
        load_worker(args.load,
                    args.scale,
                    args.save_dir,
                    weights_only=not args.no_weights_only,
                    world_size=args.load_world_size,
                    load_universal=args.load_universal,
                    verify_crc32=not args.no_verify_crc32,
                    stage=args.load_stage)
        return
    if args.save:
        save_worker(args.save, args.scale, args.save_dir, fsync=not args.no_fsync, async_save=args.async_save)
        return
    if args.save_and_train:
        save_and_train_worker(args.save_and_train,
                              args.scale,
                              args.save_dir,
                              fsync=not args.no_fsync,
                              async_save=args.async_save,
                              async_save_wait=args.async_save_wait)
        return
    if args.measure:
        print("MEASURE " + json.dumps(measure(args.command, Path(args.scratch), args.log)), flush=True)
        return

    kinds = [k for k in args.checkpoints.split(",") if k]
    tools = [t for t in args.tools.split(",") if t]
    for name in kinds:
        if name not in CHECKPOINTS:
            sys.exit(f"--checkpoints: unknown checkpoint {name!r}")
    for name in tools:
        if name not in TOOLS:
            sys.exit(f"--tools: unknown tool {name!r}")
    variants = [v for v in args.variants.split(",") if v]
    for name in variants:
        if name not in VARIANTS:
            sys.exit(f"--variants: unknown variant {name!r}")
    fork_trees = parse_fork_trees(args.fork_tree)
    if ("fork-base" in variants) != (args.base_tree is not None):
        sys.exit("--variants fork-base and --base-tree go together")
    workdir = Path(args.work_dir)
    workdir.mkdir(parents=True, exist_ok=True)
    built = prepare_trees(workdir / "trees")
    ext_dir = workdir / "torch-extensions"
    runs_dir = workdir / "runs"
    shutil.rmtree(runs_dir, ignore_errors=True)
    runs_dir.mkdir()
    descriptions = {tree: tree_description(tree) for tree in set(fork_trees.values()) | {args.base_tree} if tree}
    snapshots = {}
    for tree in descriptions:
        # A snapshot: a tree someone works in may change while the repeats run.
        snapshots[tree] = workdir / "trees" / f"snapshot-{len(snapshots)}"
        shutil.rmtree(snapshots[tree], ignore_errors=True)
        shutil.copytree(tree,
                        snapshots[tree],
                        symlinks=True,
                        ignore=shutil.ignore_patterns(".git", "build", "dist", "__pycache__", "*.egg-info"))
    fork_trees = {tool: snapshots[tree] for tool, tree in fork_trees.items()}
    base_tree = snapshots.get(args.base_tree)
    descriptions = {snapshots[tree]: f"{text} (snapshot: {snapshots[tree]})" for tree, text in descriptions.items()}
    trees = {tool: {"upstream": built["upstream"], "fork": fork_trees.get(tool, built["fork"])} for tool in TOOLS}
    for tool in TOOLS:
        for variant in VARIANT_FLAGS:
            trees[tool][variant] = trees[tool]["fork"]
        if base_tree is not None:
            trees[tool]["fork-base"] = base_tree
    head = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%h"], stdout=subprocess.PIPE,
                          text=True).stdout.strip()
    built_description = {
        "upstream": "the pinned upstream sdist, unpatched",
        "fork": f"the pinned upstream sdist + patches/series of {REPO} at {head or 'its working tree'}",
    }
    built_description["fork-trusting"] = built_description["fork"] + ", weights_only off"
    built_description["fork-no-fsync"] = built_description["fork"] + ", fsync off"
    built_description["fork-unverified"] = built_description["fork"] + ", CRC-32 check off"
    built_description["fork-async"] = built_description["fork"] + ", async_save on"
    built_description["fork-async-overlap"] = built_description["fork-async"] + ", async_save_wait save"
    built_description["fork-base"] = args.base_tree

    results = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine":
        f"{os.cpu_count()} CPUs, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB",
        "scale": args.scale,
        "repeats": args.repeats,
        "saved_by": args.save_with,
        "trees": {
            tool: {
                v: descriptions.get(t, built_description[v])
                for v, t in trees[tool].items() if v in variants
            }
            for tool in tools
        },
        "checkpoints": {},
    }
    for tool in tools:
        for variant in variants:
            print(f"{tool} {variant}: {results['trees'][tool][variant]}")
    metas = {
        kind: ensure_checkpoint(kind, args.scale, workdir, built[args.save_with], args.save_with, ext_dir)
        for kind in kinds
    }
    if args.create_only:
        return

    # What every run of a tool pays before it reads a byte: the interpreter and the imports.
    results["import_deepspeed"] = {}
    for variant in sorted({v.split("-")[0] for v in variants}):
        runs = [
            run_tool("import deepspeed", variant, built[variant], None, runs_dir, ext_dir, False, r)
            for r in range(args.repeats)
        ]
        summary = summarize(runs)
        if "error" in summary:
            sys.exit(f"python -c 'import deepspeed' fails on {variant}: {summary['error']}")
        results["import_deepspeed"][variant] = dict(summary, all=runs)
        print(
            f"python -c 'import deepspeed', {variant}: {summary['seconds']:.2f} s, "
            f"peak RSS {gb(summary['maxrss']):.2f} GB",
            flush=True)

    print("\n| checkpoint | tool | variant | time s: median (runs) | x cp -r | peak RSS GB, largest process "
          "| peak PSS GB, process tree (anonymous) | peak extra disk GB | output GB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind in kinds:
        meta = metas[kind]
        checkpoint_dir = workdir / "checkpoints" / args.scale / kind
        entry = {"meta": meta, "page_cache_resident": [], "tools": {}}
        results["checkpoints"][kind] = entry
        print(
            f"| {kind}: {meta['num_params'] / 1e6:.1f}M parameters, {gb(meta['bytes']):.2f} GB, "
            f"{meta['files']} files | | | | | | | | |",
            flush=True)

        def timed(tool, variant, tree, inject, repeat):
            entry["page_cache_resident"].append(warm(checkpoint_dir))
            return run_tool(tool, variant, tree, checkpoint_dir, runs_dir, ext_dir, inject, repeat)

        if "load_universal" in tools:
            ensure_universal(checkpoint_dir, built["fork"], ext_dir)
        cp_runs = [timed("cp -r", "-", None, False, r) for r in range(args.repeats)]
        cp = summarize(cp_runs)
        if "error" in cp:
            sys.exit(f"cp -r failed: {cp['error']}")
        entry["tools"]["cp -r"] = {"-": dict(cp, all=cp_runs)}
        print(table_row(kind, meta, "cp -r", "-", cp, cp["seconds"]), flush=True)
        if {"zero_to_fp32", "ds_to_universal"} & set(tools):
            synced_runs = [timed("cp -r + sync", "-", None, False, r) for r in range(args.repeats)]
            synced = summarize(synced_runs)
            entry["tools"]["cp -r + sync"] = {"-": dict(synced, all=synced_runs)}
            print(table_row(kind, meta, "cp -r + sync", "-", synced, cp["seconds"]), flush=True)
        for tool in tools:
            # The command is the fork's own: upstream has none, and it has no option to compare.
            tool_variants = [v for v in variants if v == "fork"] if tool == "ds_verify_checkpoint" else variants
            runs = {variant: [] for variant in tool_variants}
            inject = {variant: False for variant in tool_variants}
            for repeat in range(args.repeats):
                for variant in tool_variants:
                    if runs[variant] and "error" in runs[variant][-1]:
                        continue  # refused: once is enough
                    result = timed(tool, variant, trees[tool][variant], inject[variant], repeat)
                    if (tool == "ds_to_universal" and "error" in result and not inject[variant]
                            and any(hint in Path(result["log"]).read_text(errors="replace") for hint in INJECT_HINTS)):
                        # What a user does next: the tool names the option.
                        inject[variant] = True
                        result = timed(tool, variant, trees[tool][variant], True, repeat)
                    runs[variant].append(result)
            entry["tools"][tool] = {}
            for variant in tool_variants:
                summary = summarize(runs[variant])
                entry["tools"][tool][variant] = dict(summary, all=runs[variant])
                print(table_row(kind, meta, tool, variant, summary, cp["seconds"]), flush=True)
                if tool == "save_and_train" and "error" not in summary:
                    ok = [run for run in runs[variant] if "error" not in run]
                    print(f"| {kind} | `{tool}` | {variant} | " + ", ".join(
                        f"{key} {median_of(ok, key):.2f}"
                        for key in ("cost_s", "save_s", "steps_slower_s", "drain_s", "step_s")) + " | | | | | |",
                          flush=True)
        resident = [r for r in entry["page_cache_resident"] if r is not None]
        if resident:
            print(
                f"| {kind}: checkpoint pages resident before the timed runs: "
                f"{100 * min(resident):.0f}-{100 * max(resident):.0f} % | | | | | | | | |",
                flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
