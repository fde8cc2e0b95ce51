# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The in-tree build backend: pinned sdist + series -> wheel, and its refusals."""

import os
import zipfile

from conftest import pip_wheel, tree_files

from forktools.series import read_series


def _patch_files(repo):
    return sorted((repo / "patches").glob("*.patch"))


def test_wheel_carries_the_series_and_a_local_version(repo_copy, upstream_sdist, tmp_path):
    before = tree_files(repo_copy)
    proc = pip_wheel(repo_copy, tmp_path / "out", sdist=upstream_sdist)
    assert proc.returncode == 0, proc.stdout
    (wheel, ) = (tmp_path / "out").glob("*.whl")
    patches = read_series(repo_copy)
    # A PEP 440 local label: `deepspeed==0.19.8` requirements of other packages still match.
    assert wheel.name.startswith(f"deepspeed-0.19.8+fork.{len(patches)}.")
    with zipfile.ZipFile(wheel) as zf:
        info = zf.read("deepspeed/fork_info_installed.py").decode()
        coordinator = zf.read("deepspeed/runtime/zero/partitioned_param_coordinator.py").decode()
        shm_op = zf.read("deepspeed/ops/csrc/cpu/comm/shm_interface.cpp").decode()
    assert "base_version = '0.19.8'" in info
    for patch in patches:
        assert patch.name in info
    assert "if pending_params:" in coordinator
    # Patches change csrc/, a symbolic link's target in upstream's repository; the wheel installs the copy.
    assert "unlink_workspace" in shm_op
    assert tree_files(repo_copy) == before, "the build wrote into the source tree"


def test_hash_mismatch_names_the_file(repo_copy, upstream_sdist, tmp_path):
    pin = repo_copy / "upstream.toml"
    text = pin.read_text()
    sha = text.split('sha256 = "')[1][:64]
    flipped = ("0" if sha[0] != "0" else "1") + sha[1:]
    pin.write_text(text.replace(sha, flipped))
    before = tree_files(repo_copy)

    proc = pip_wheel(repo_copy, tmp_path / "out", sdist=upstream_sdist)
    assert proc.returncode != 0
    assert f"sha256 mismatch for {upstream_sdist}" in proc.stdout
    assert f"expected {flipped}" in proc.stdout
    assert f"got      {sha}" in proc.stdout
    assert not list((tmp_path / "out").glob("*.whl"))
    assert tree_files(repo_copy) == before


def test_missing_local_sdist(repo_copy, tmp_path):
    missing = tmp_path / "nowhere" / "deepspeed-0.19.8.tar.gz"
    proc = pip_wheel(repo_copy, tmp_path / "out", sdist=missing)
    assert proc.returncode != 0
    assert f"upstream sdist {missing}" in proc.stdout and "does not exist" in proc.stdout


def test_sdist_not_on_the_index(repo_copy, tmp_path):
    empty_index = tmp_path / "empty-index"
    empty_index.mkdir()
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(empty_index))
    proc = pip_wheel(repo_copy, tmp_path / "out", env=env)
    assert proc.returncode != 0
    assert "could not fetch the upstream sdist deepspeed-0.19.8.tar.gz (deepspeed==0.19.8) with pip" in proc.stdout


def test_offline_build_through_pip_find_links(repo_copy, upstream_sdist, tmp_path):
    """pip's own settings reach the sdist download: a local folder as the only index."""
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(upstream_sdist.parent))
    proc = pip_wheel(repo_copy, tmp_path / "out", env=env)
    assert proc.returncode == 0, proc.stdout
    assert len(list((tmp_path / "out").glob("deepspeed-0.19.8+fork.*.whl"))) == 1


def test_patch_that_no_longer_applies_names_patch_file_and_hunk(repo_copy, upstream_sdist, tmp_path):
    patch = _patch_files(repo_copy)[0]
    lines = patch.read_text().splitlines(keepends=True)
    # Change one context line of the first hunk.
    first_hunk = next(i for i, line in enumerate(lines) if line.startswith("@@ "))
    context = next(i for i in range(first_hunk + 1, len(lines)) if lines[i].startswith(" ") and lines[i].strip())
    lines[context] = lines[context].rstrip("\n") + "  # changed\n"
    patch.write_text("".join(lines))
    target = next(line.split(" b/", 1)[1].strip() for line in lines if line.startswith("diff --git "))
    before = tree_files(repo_copy)

    proc = pip_wheel(repo_copy, tmp_path / "out", sdist=upstream_sdist)
    assert proc.returncode != 0
    assert f"patch {patch.name} does not apply" in proc.stdout
    assert f"target file: {target}" in proc.stdout
    assert f"failing hunk: #1 in {target}" in proc.stdout
    assert "# changed" in proc.stdout  # the hunk itself is shown
    assert not list((tmp_path / "out").glob("*.whl"))
    assert tree_files(repo_copy) == before


def test_series_naming_a_missing_patch(repo_copy, upstream_sdist, tmp_path):
    series = repo_copy / "patches" / "series"
    series.write_text(series.read_text() + "9999-missing.patch\n")
    proc = pip_wheel(repo_copy, tmp_path / "out", sdist=upstream_sdist)
    assert proc.returncode != 0
    assert "lists 9999-missing.patch" in proc.stdout and "does not exist" in proc.stdout
