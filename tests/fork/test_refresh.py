# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``python -m forktools refresh``: the series replayed onto a new upstream release, then re-pinned.

No newer release exists, so each test makes one from the pinned sdist: renamed to 0.19.9 and
changed the way a real release would change the files the series touches. Each refresh replays
the series in a real queue (a few seconds); the two tests take about 25 s together.
"""

import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

from conftest import forktools, git, tree_files

from forktools.series import apply_patch, parse_patch, read_series, series_names
from forktools.upstream import read_pin, sha256_of

NEW = "0.19.9"
GATE = "0002-zero3-gate-the-fetch-all-gather-on-pending-status-not-numel.patch"
NEVER_PARTITION = "0004-zero3-never-partition-zero-element-parameters.patch"
ZERO_TO_FP32 = "0005-zero_to_fp32-restore-zero-element-parameters-of-ZeRO-1-2-checkpoints.patch"
LINEAR = "0007-zero3-compute-the-linear-weight-gradient-of-zero-width-layers.patch"
# Touches the file the gate fix changes, below it: once upstream has the gate fix, it applies at an offset.
LEAF = "0001-zero3-reduce-leaf-module-gradients-after-they-are-computed.patch"
# A context line of NEVER_PARTITION's hunk in partition_parameters.py, and what the conflicting release
# makes of it.
NEVER_PARTITION_CONTEXT = 'print_rank_0(f"Before Partitioning Param {param.ds_id}", force=False)'
NEVER_PARTITION_CONTEXT_NEW = 'print_rank_0(f"Before partitioning param {param.ds_id}", force=False)'


def unpack(sdist, dest):
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="data")
    (tree, ) = Path(dest).iterdir()
    return tree


def make_release(upstream_sdist, workdir, change):
    """deepspeed-0.19.9.tar.gz: the pinned sdist under the new version, with ``change(tree)`` applied."""
    tree = unpack(upstream_sdist, workdir / "src")
    old = tree.name.rsplit("-", 1)[1]
    tree = tree.rename(tree.with_name(f"deepspeed-{NEW}"))
    (tree / "version.txt").write_text((tree / "version.txt").read_text().replace(old, NEW))
    for pkg_info in [tree / "PKG-INFO", *tree.glob("*.egg-info/PKG-INFO")]:
        pkg_info.write_text(pkg_info.read_text().replace(f"\nVersion: {old}\n", f"\nVersion: {NEW}\n"))
    change(tree)
    sdist = workdir / f"deepspeed-{NEW}.tar.gz"
    with tarfile.open(sdist, "w:gz", compresslevel=1) as tar:
        tar.add(tree, arcname=tree.name)
    return sdist


def report_of(output):
    """Patch name -> what the refresh reported for it."""
    return {
        line.strip().split(": ", 1)[0]: line.strip().split(": ", 1)[1]
        for line in output.splitlines() if line.startswith("  00") and ": " in line
    }


def test_refresh_drops_what_upstream_has_and_refreshes_what_moved(repo_copy, upstream_sdist, tmp_path):
    old_names = series_names(repo_copy)
    old_patches = {patch.name: patch for patch in read_series(repo_copy)}
    old_bytes = {name: patch.path.read_bytes() for name, patch in old_patches.items()}

    def change(tree):
        # Upstream takes the gate fix (0002) ...
        apply_patch(tree, old_patches[GATE])
        # ... adds lines above the hunk of 0007, so that it applies at an offset ...
        linear = tree / "deepspeed/runtime/zero/linear.py"
        lines = linear.read_text().splitlines(keepends=True)
        linear.write_text("".join(lines[:4] + ["\n", "# Added upstream in 0.19.9.\n"] + lines[4:]))
        # ... and changes engine.py far below the hunks of the patches touching it: they apply exactly.
        with open(tree / "deepspeed/runtime/engine.py", "a") as engine:
            engine.write("# Added upstream in 0.19.9.\n")

    release = make_release(upstream_sdist, tmp_path / "release", change)
    before = tree_files(repo_copy)
    queue = tmp_path / "queue"

    dry = forktools(repo_copy, "refresh", "--to", NEW, "--sdist", str(release), "--dir", str(queue), "--dry-run")
    assert dry.returncode == 0, dry.stdout
    assert "dry run: nothing written" in dry.stdout and "  write upstream.toml" in dry.stdout
    assert tree_files(repo_copy) == before and not queue.exists()

    proc = forktools(repo_copy, "refresh", "--to", NEW, "--sdist", str(release), "--dir", str(queue))
    assert proc.returncode == 0, proc.stdout
    print(proc.stdout)
    new_names = series_names(repo_copy)
    renamed = dict(zip([name for name in old_names if name != GATE], new_names))
    expected = {name: f"applies unchanged (now {renamed[name]})" for name in old_names if name != GATE}
    expected[GATE] = f"already in upstream -> patches/applied-upstream/{GATE} (Applied-Upstream: {NEW})"
    for name, patch_bytes in old_bytes.items():
        # Every patch that touches engine.py applies exactly; only its blob ids change.
        if name != GATE and b"diff --git a/deepspeed/runtime/engine.py " in patch_bytes:
            expected[name] = f"applies unchanged (now {renamed[name]}, index lines refreshed)"
    assert ZERO_TO_FP32 in expected and "index lines refreshed" in expected[ZERO_TO_FP32]
    expected[LINEAR] = f"applies with offsets (refreshed) (now {renamed[LINEAR]})"
    expected[LEAF] = "applies with offsets (refreshed)"  # before the dropped patch: its name stays
    assert report_of(proc.stdout) == expected
    assert report_of(dry.stdout) == expected

    # The new pin: the release's version and the sha256 of the file itself.
    pin = read_pin(repo_copy)
    assert (pin.version, pin.sha256) == (NEW, sha256_of(release))
    # The series without the gate fix, in the same order, renumbered as `pq export` numbers it.
    assert [parse_patch(repo_copy / "patches" / name).subject
            for name in new_names] == [old_patches[name].subject for name in old_names if name != GATE]
    assert not (repo_copy / "patches" / GATE).exists()
    # The gate fix kept, with its trailer set to the release that has it, and the same diff.
    applied = repo_copy / "patches" / "applied-upstream" / GATE
    assert parse_patch(applied).dep3["Applied-Upstream"] == NEW
    assert applied.read_bytes().split(b"\n---\n", 1)[1] == old_bytes[GATE].split(b"\n---\n", 1)[1]
    # Patches that apply unchanged keep their bytes; the moved one has new hunk headers.
    unchanged = [name for name, outcome in expected.items() if outcome == f"applies unchanged (now {renamed.get(name)})"]
    assert unchanged
    for name in unchanged:
        assert (repo_copy / "patches" / renamed[name]).read_bytes() == old_bytes[name], name
    assert (repo_copy / "patches" / renamed[LINEAR]).read_bytes() != old_bytes[LINEAR]

    # Every patch of the new series applies to the release exactly: no offsets left.
    tree = unpack(release, tmp_path / "check")
    for name in new_names:
        applied_now = subprocess.run(["git", "apply", "-v", str(repo_copy / "patches" / name)],
                                     cwd=tree,
                                     env=dict(os.environ, LC_ALL="C", GIT_CEILING_DIRECTORIES=str(tree.parent)),
                                     stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT,
                                     text=True)
        assert applied_now.returncode == 0 and "offset" not in applied_now.stdout, applied_now.stdout

    # The queue left behind is the new series: exporting it changes nothing.
    export = forktools(repo_copy, "pq", "export", "--dir", str(queue))
    assert export.returncode == 0 and "patches/ is up to date" in export.stdout, export.stdout

    # And the fork builds on the new release.
    built = forktools(repo_copy, "tree", "--sdist", str(release))
    assert built.returncode == 0, built.stdout
    patched = Path(built.stdout.strip().splitlines()[-1])
    try:
        assert f"base_version = '{NEW}'" in (patched / "deepspeed/fork_info_installed.py").read_text()
    finally:
        shutil.rmtree(patched.parents[1])


def test_conflict_stops_in_a_resumable_queue_and_changes_nothing(repo_copy, upstream_sdist, tmp_path):
    old_patches = {patch.name: patch for patch in read_series(repo_copy)}
    target = "deepspeed/runtime/zero/partition_parameters.py"

    def change(tree):
        # Upstream rewrites a line that a hunk of NEVER_PARTITION has as context.
        path = tree / target
        text = path.read_text()
        assert text.count(NEVER_PARTITION_CONTEXT) == 1
        path.write_text(text.replace(NEVER_PARTITION_CONTEXT, NEVER_PARTITION_CONTEXT_NEW))

    release = make_release(upstream_sdist, tmp_path / "release", change)
    before = tree_files(repo_copy)
    queue = tmp_path / "queue"

    proc = forktools(repo_copy, "refresh", "--to", NEW, "--sdist", str(release), "--dir", str(queue))
    print(proc.stdout)
    assert proc.returncode != 0
    report = report_of(proc.stdout)
    names = list(old_patches)
    before_conflict = names[:names.index(NEVER_PARTITION)]
    assert all(report[name] == "applies unchanged" for name in before_conflict)
    assert report[NEVER_PARTITION] == f"conflicts in {target}"
    assert all(report[name] == "not tried" for name in names[len(before_conflict) + 1:])
    assert f"{target}.rej" in proc.stdout and "refresh --continue" in proc.stdout
    assert tree_files(repo_copy) == before, "a conflicting refresh changed upstream.toml or patches/"

    # The queue: the new base, the patches before NEVER_PARTITION, and git am stopped on it.
    assert git(queue, "log", "-1", "--format=%s", "upstream").strip() == f"deepspeed {NEW} (pristine sdist)"
    assert git(queue, "log", "--reverse", "--format=%s",
               "upstream..HEAD").splitlines() == [old_patches[name].subject for name in before_conflict]
    assert (queue / ".git" / "rebase-apply").is_dir()
    assert old_patches[NEVER_PARTITION].subject in git(queue, "am", "--show-current-patch=raw")
    assert (queue / f"{target}.rej").is_file()
    # The hunks that apply, staged: all of the patch's files, the conflicting one in part.
    patch_files = sorted(re.findall(r"^diff --git a/(\S+) ", old_patches[NEVER_PARTITION].path.read_text(), re.M))
    assert target in patch_files
    assert git(queue, "diff", "--cached", "--name-only").split() == patch_files

    # Continuing before git am is done is refused, and still changes nothing.
    early = forktools(repo_copy, "refresh", "--continue", "--dir", str(queue))
    assert early.returncode != 0 and "git am is still stopped" in early.stdout
    assert tree_files(repo_copy) == before

    # Resolve as a maintainer would: the patch with its context line updated, then git am --continue.
    git(queue, "checkout", "HEAD", "--", *patch_files)
    (queue / f"{target}.rej").unlink()
    patch_text = old_patches[NEVER_PARTITION].path.read_text()
    assert patch_text.count(NEVER_PARTITION_CONTEXT) == 1
    resolved = tmp_path / "resolved.patch"
    resolved.write_text(patch_text.replace(NEVER_PARTITION_CONTEXT, NEVER_PARTITION_CONTEXT_NEW))
    git(queue, "apply", "--index", str(resolved))
    git(queue, "-c", "user.name=Test Maintainer", "-c", "user.email=test@example.invalid", "am", "--continue")

    done = forktools(repo_copy, "refresh", "--continue", "--dir", str(queue))
    print(done.stdout)
    assert done.returncode == 0, done.stdout
    report = report_of(done.stdout)
    assert report[NEVER_PARTITION] == "conflict resolved in the queue (refreshed)"
    assert all(report[name] == "applies unchanged" for name in names if name != NEVER_PARTITION)
    assert (read_pin(repo_copy).version, read_pin(repo_copy).sha256) == (NEW, sha256_of(release))
    assert series_names(repo_copy) == names
    assert f" {NEVER_PARTITION_CONTEXT_NEW}\n" in (repo_copy / "patches" / NEVER_PARTITION).read_text()
