# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Fixtures for the tests of the fork's own tooling (forktools): these never go upstream."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from forktools.backend import SDIST_CONTENTS  # noqa: E402
from forktools.upstream import fetch_sdist, read_pin  # noqa: E402


@pytest.fixture(scope="session")
def upstream_sdist(tmp_path_factory):
    """The pinned upstream sdist under its own name, fetched once per session (or copied from DS_FORK_SDIST)."""
    pin = read_pin(REPO)
    folder = tmp_path_factory.mktemp("upstream-sdist")
    sdist = fetch_sdist(pin, folder)
    if sdist.parent != folder:
        sdist = Path(shutil.copyfile(sdist, folder / pin.sdist_name))
    return sdist


def copy_repo(dest):
    """The files that define the fork (what its sdist holds), copied so that tests may break them."""
    dest.mkdir(parents=True)
    for name in SDIST_CONTENTS:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif src.exists():
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture
def repo_copy(tmp_path):
    return copy_repo(tmp_path / "repo")


def pip_wheel(repo, outdir, sdist=None, env=None):
    """``pip wheel`` the fork at ``repo``; returns the finished process (stdout and stderr together)."""
    env = dict(os.environ if env is None else env)
    env.pop("DS_FORK_SDIST", None)
    if sdist is not None:
        env["DS_FORK_SDIST"] = str(sdist)
    # --no-build-isolation: the test environment already has the build requirements, and a
    # fresh isolated environment per build would only add time (the README's `pip install .`
    # exercises isolation).
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(outdir), str(repo)]
    return subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def tree_files(root):
    """Relative path -> bytes of every file below root, to check that a build wrote nothing there.

    Byte-code caches are left out: importing the backend writes them, and they are no build output.
    """
    return {
        p.relative_to(root): p.read_bytes()
        for p in sorted(Path(root).rglob("*")) if p.is_file() and "__pycache__" not in p.parts
    }


def forktools(repo, *args):
    """Run the forktools of the fork at ``repo``: ``python -m`` puts the working directory first on sys.path."""
    return subprocess.run([sys.executable, "-m", "forktools", *args],
                          cwd=repo,
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT,
                          text=True)


def git(queue, *args):
    """``git -C queue ARGS``, asserting success; returns its output."""
    proc = subprocess.run(["git", "-C", str(queue), *args],
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT,
                          text=True)
    assert proc.returncode == 0, proc.stdout
    return proc.stdout


@pytest.fixture(scope="session")
def wheels(builds):
    """The wheel per build that `builds` installed."""
    return {name: next((site.parent / "wheel").glob("*.whl")) for name, site in builds.items()}


@pytest.fixture(scope="session")
def builds(tmp_path_factory, upstream_sdist):
    """site directory per build: 'fork' (the series) and 'upstream' (the same backend, empty series),
    built once per session for every test that runs code under both."""
    sites = {}
    for name in ("fork", "upstream"):
        root = tmp_path_factory.mktemp(name)
        repo = copy_repo(root / "repo")
        if name == "upstream":
            (repo / "patches" / "series").write_text("")
        proc = pip_wheel(repo, root / "wheel", sdist=upstream_sdist)
        assert proc.returncode == 0, proc.stdout
        (wheel, ) = (root / "wheel").glob("*.whl")
        site = root / "site"
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
             str(site), str(wheel)], check=True)
        sites[name] = site
    return sites
