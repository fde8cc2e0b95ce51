# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The in-tree build backend: pinned sdist + series -> wheel, and its refusals."""

import os
import shutil
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from conftest import pip_wheel, tree_files

from forktools.series import read_series
from forktools.upstream import read_pin, sha256_of


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


def _hostile_sdist(folder, marker):
    """A fake ``deepspeed-0.19.8.tar.gz`` whose setup.py, if anything runs it, writes ``marker``."""
    src = folder / "src" / "deepspeed-0.19.8"
    src.mkdir(parents=True)
    (src / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.19.8\n")
    (src / "setup.py").write_text(f"from pathlib import Path\n"
                                  f"Path({str(marker)!r}).write_text('upstream code ran')\n"
                                  f"from setuptools import setup\n"
                                  f"setup(name='deepspeed', version='0.19.8')\n")
    sdist = folder / "files" / "deepspeed-0.19.8.tar.gz"
    sdist.parent.mkdir(parents=True)
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(src, arcname=src.name)
    return sdist


def test_hostile_index_sdist_is_refused_before_its_code_runs(repo_copy, tmp_path):
    """A wrong file from the index fails pip's hash check before pip prepares (runs) it."""
    root, marker = tmp_path / "index", tmp_path / "setup-py-ran"
    sdist = _hostile_sdist(root, marker)
    project = root / "simple" / "deepspeed"
    project.mkdir(parents=True)
    (project / "index.html").write_text(f'<a href="../../files/{sdist.name}">{sdist.name}</a>\n')
    pinned = read_pin(repo_copy).sha256
    before = tree_files(repo_copy)

    # A real index over HTTP on a free port (port 0); it prints the port it got, and logs requests to stderr.
    serve = [sys.executable, "-u", "-m", "http.server", "0", "--bind", "127.0.0.1", "--directory", str(root)]
    server = subprocess.Popen(serve, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        port = re.search(r" port (\d+)", server.stdout.readline()).group(1)
        # The hostile index is pip's only source: no configuration files, find-links or extra indexes.
        env = dict(os.environ, PIP_INDEX_URL=f"http://127.0.0.1:{port}/simple", PIP_CONFIG_FILE=os.devnull)
        for key in ("PIP_NO_INDEX", "PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"):
            env.pop(key, None)
        proc = pip_wheel(repo_copy, tmp_path / "out", env=env)
    finally:
        server.terminate()
        server.wait()
    assert proc.returncode != 0
    assert not marker.exists(), "pip ran the hostile sdist's setup.py before the hash was checked"
    assert f"sha256 mismatch for {sdist.name} from http://127.0.0.1:{port}/files/{sdist.name}" in proc.stdout
    assert f"expected {pinned}" in proc.stdout
    assert f"got      {sha256_of(sdist)}" in proc.stdout
    assert not list((tmp_path / "out").glob("*.whl"))
    assert tree_files(repo_copy) == before


def test_patch_leaving_the_sdist_copy_of_a_csrc_file_behind_is_refused(repo_copy, upstream_sdist, tmp_path):
    """The wheel installs deepspeed/ops/csrc, the sdist's copy of csrc/: a patch that changes only csrc/ would
    build a wheel without the change, so the build names the patch and the copy."""
    copies = "deepspeed/ops/csrc/"
    (patch, ) = [p for p in _patch_files(repo_copy) if f"diff --git a/{copies}" in p.read_text()]
    sections = re.split(r"(?m)^(?=diff --git )", patch.read_text())
    patch.write_text("".join(section for section in sections if not section.startswith(f"diff --git a/{copies}")))
    proc = pip_wheel(repo_copy, tmp_path / "out", sdist=upstream_sdist)
    assert proc.returncode != 0
    assert f"patch {patch.name} changes csrc/" in proc.stdout, proc.stdout
    assert f"not the sdist's copy of it, {copies}" in proc.stdout
    assert not list((tmp_path / "out").glob("*.whl"))


def test_tree_from_a_plain_venv(repo_copy, upstream_sdist, tmp_path):
    """The maintainer commands work from ``python3 -m venv`` alone: its setuptools cannot prepare the sdist's
    metadata without the ``wheel`` package, which such a venv lacks, so the download builds in isolation."""
    venv = tmp_path / "venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    has_wheel = subprocess.run([python, "-c", "import wheel"], capture_output=True).returncode == 0
    env = {key: value for key, value in os.environ.items() if key not in ("DS_FORK_SDIST", "PYTHONPATH")}
    env["PIP_FIND_LINKS"] = str(upstream_sdist.parent)
    proc = subprocess.run([python, "-m", "forktools", "tree"],
                          cwd=repo_copy,
                          env=env,
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT,
                          text=True)
    assert not has_wheel, "the venv was to be without the wheel package"
    assert proc.returncode == 0, proc.stdout
    tree = proc.stdout.strip().splitlines()[-1]
    assert (Path(tree) / "deepspeed" / "fork_info.py").is_file()
    shutil.rmtree(Path(tree).parents[1])
