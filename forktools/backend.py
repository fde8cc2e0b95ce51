"""PEP 517 build backend: the pinned upstream sdist, plus the patch series, built into a ``deepspeed`` wheel.

``pip install .``, ``pip install git+<url>`` and ``python -m build`` all come through here. The work
happens in a temporary directory; the only thing written into the caller's tree is the finished
wheel (or sdist), moved into place once complete.

Config settings (``pip install -C sdist=PATH .`` or ``python -m build -C sdist=PATH``), or the
environment variable DS_FORK_SDIST, name a local copy of the pinned sdist for offline builds.
"""

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from forktools import ForkError
from forktools.files import replace_file
from forktools.series import PATCH_DIR, local_version_label, read_series
from forktools.upstream import PIN_FILE, make_workdir, pinned_release, read_pin

REPO = Path(__file__).resolve().parent.parent
# What an sdist of this repository must hold to build the wheel again.
SDIST_CONTENTS = ("pyproject.toml", PIN_FILE, PATCH_DIR, "forktools", "README.md", "LICENSE")
FORK_INFO_MODULE = "fork_info_installed.py"


def _fail(err):
    # A backend's exception reaches the user as a long traceback from pip's hook runner; the
    # message is what matters, so print it alone and stop.
    raise SystemExit(f"\nERROR: deepspeed fork build failed:\n{err}\n")


def _write_fork_info(tree, pin, patches):
    """Record the base release and the series in the package, for ds_report and deepspeed.fork_info."""
    summaries = tuple(patch.summary() for patch in patches)
    text = ("# Written by the fork's build backend (forktools.backend): what this build carries.\n"
            f"base_version = {pin.version!r}\n"
            f"patches = {summaries!r}\n")
    (tree / "deepspeed" / FORK_INFO_MODULE).write_text(text)


def build_patched_tree(workdir, config_settings=None, patches=None):
    """Fetch, verify and unpack the pinned sdist into ``workdir`` and apply the series (or ``patches``,
    ``[]`` for the pristine release) to it.

    Returns (tree, local version label). Raises ForkError with a message naming the cause.
    """
    config_settings = config_settings or {}
    patches = read_series(REPO) if patches is None else patches
    release = pinned_release(REPO, workdir, config_settings.get("sdist"))
    tree = release.tree(workdir / "src", patches)
    _write_fork_info(tree, release.pin, patches)
    return tree, local_version_label(REPO, patches)


def patched_wheel(workdir, config_settings=None, patches=None):
    """The wheel of the patched tree (see build_patched_tree), built under ``workdir``; returns its path."""
    tree, label = build_patched_tree(workdir, config_settings, patches)
    return _upstream_wheel(tree, label, workdir / "dist")


def _upstream_wheel(tree, label, outdir):
    """Run upstream's own setup.py build in a child process (it reads files relative to its cwd)."""
    env = dict(os.environ)
    # DS_BUILD_STRING is upstream's hook for a version suffix; it also stops setup.py from
    # asking git for a hash of whatever repository happens to be around.
    env["DS_BUILD_STRING"] = f"+{label}"
    code = ("import sys; from setuptools.build_meta import __legacy__ as backend; "
            "print(backend.build_wheel(sys.argv[1]))")
    proc = subprocess.run([sys.executable, "-c", code, str(outdir)],
                          cwd=tree,
                          env=env,
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT,
                          text=True)
    if proc.returncode != 0:
        raise ForkError("upstream's setup.py failed to build the wheel of the patched tree:\n" + proc.stdout[-4000:])
    return outdir / proc.stdout.strip().splitlines()[-1]


def _move_into(src, directory):
    """Put a finished artifact into the caller's directory under its final name, atomically."""
    replace_file(Path(directory) / src.name, src.read_bytes())
    return src.name


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    workdir = make_workdir("deepspeed-fork-build-")
    try:
        return _move_into(patched_wheel(workdir, config_settings), wheel_directory)
    except ForkError as err:
        _fail(err)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def _sdist_version():
    pin = read_pin(REPO)
    return f"{pin.version}+{local_version_label(REPO, read_series(REPO))}"


def build_sdist(sdist_directory, config_settings=None):
    """An sdist of the fork's own files (pin, series, backend): building it yields the same wheel."""
    try:
        version = _sdist_version()
    except ForkError as err:
        _fail(err)
    base = f"deepspeed-{version}"
    workdir = make_workdir("deepspeed-fork-sdist-")
    try:
        archive = workdir / f"{base}.tar.gz"
        pkg_info = f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {version}\n"
        (workdir / "PKG-INFO").write_text(pkg_info)
        with tarfile.open(archive, "w:gz", format=tarfile.PAX_FORMAT) as tar:
            tar.add(workdir / "PKG-INFO", arcname=f"{base}/PKG-INFO")
            for name in SDIST_CONTENTS:
                path = REPO / name
                if path.exists():
                    tar.add(path, arcname=f"{base}/{name}", filter=_skip_caches)
        return _move_into(archive, sdist_directory)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _skip_caches(info):
    return None if "__pycache__" in info.name.split("/") else info
