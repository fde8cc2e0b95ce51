# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The series works outside the fork's build: ``patch -p1`` of every patch, in series order, onto the unpacked
upstream sdist gives the tree the build makes (the build adds only its record of the series)."""

import stat
import subprocess
import tarfile
from pathlib import Path

from conftest import REPO, tree_files

from forktools.backend import FORK_INFO_MODULE, build_patched_tree
from forktools.series import series_names


def executable_files(root):
    return {path.relative_to(root) for path in root.rglob("*") if path.is_file() and path.stat().st_mode & stat.S_IXUSR}


def test_series_applies_with_plain_patch_and_gives_the_build_tree(upstream_sdist, tmp_path):
    with tarfile.open(upstream_sdist) as tar:
        tar.extractall(tmp_path / "plain", filter="data")
    (plain, ) = (tmp_path / "plain").iterdir()
    for name in series_names(REPO):
        # --fuzz=0: every hunk must apply where it says, as the build's git apply requires.
        proc = subprocess.run(["patch", "-p1", "--batch", "--forward", "--fuzz=0", "-i",
                               str(REPO / "patches" / name)],
                              cwd=plain,
                              stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT,
                              text=True)
        assert proc.returncode == 0, f"{name}:\n{proc.stdout}"
        assert not list(plain.rglob("*.orig")) and not list(plain.rglob("*.rej")), f"{name}:\n{proc.stdout}"

    built, _ = build_patched_tree(tmp_path / "build", {"sdist": str(upstream_sdist)})
    build_files = tree_files(built)
    # What the build adds beside the series: its record of the series (deepspeed.fork_info reads it).
    del build_files[Path("deepspeed") / FORK_INFO_MODULE]
    plain_files = tree_files(plain)
    assert sorted(plain_files) == sorted(build_files)
    differing = [str(path) for path in plain_files if plain_files[path] != build_files[path]]
    assert not differing, f"patch -p1 and the build disagree on {differing}"
    assert executable_files(plain) == executable_files(built)
