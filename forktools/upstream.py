"""The pinned upstream release: reading the pin, fetching and verifying its sdist, unpacking it (as a plain
tree, with patches applied, or as the base of a patch queue)."""

import hashlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from forktools import ForkError
from forktools.git import identity_env, repo_env, run_git
from forktools.series import apply_series

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

PIN_FILE = "upstream.toml"
# Set to the path of a local copy of the pinned sdist to build without asking an index.
SDIST_ENV = "DS_FORK_SDIST"
# The tag of a patch queue's base commit: the pristine sdist.
BASE_TAG = "upstream"
# The base commit is made with a fixed identity and date so that every import of the same
# release yields the same commit ids.
_BASE_IDENTITY = identity_env("upstream", "upstream@invalid", date="1970-01-01T00:00:00+0000")
# Where the CPU all-reduce op of a pristine release leaves a 66 MiB shared-memory segment per rank
# and run (the fork's cpu-shm-allreduce-cleanup topic removes them).
SHM_DIR = Path("/dev/shm")
SHM_SEGMENT_GLOB = "deepspeed_allreduce_buffer_*"


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    sha256: str

    @property
    def sdist_name(self):
        return f"{self.name}-{self.version}.tar.gz"

    @property
    def requirement(self):
        return f"{self.name}=={self.version}"


def read_pin(repo):
    path = Path(repo) / PIN_FILE
    try:
        table = tomllib.loads(path.read_text())["upstream"]
        pin = Pin(name=table["name"], version=table["version"], sha256=table["sha256"].lower())
    except FileNotFoundError:
        raise ForkError(f"{path}: the upstream pin file is missing")
    except (tomllib.TOMLDecodeError, KeyError, TypeError, AttributeError) as err:
        raise ForkError(f"{path}: expected an [upstream] table with name, version and sha256 ({err!r})")
    if len(pin.sha256) != 64 or any(c not in "0123456789abcdef" for c in pin.sha256):
        raise ForkError(f"{path}: sha256 {pin.sha256!r} is not a 64-digit hex sha256")
    return pin


def pin_file_text(repo, pin):
    """upstream.toml's text with ``pin``'s version and sha256 in place of the current ones (comments kept)."""
    path = Path(repo) / PIN_FILE
    text = path.read_text()
    for key, value in (("version", pin.version), ("sha256", pin.sha256)):
        text, count = re.subn(rf'^{key}\s*=\s*"[^"\n]*"', f'{key} = "{value}"', text, count=1, flags=re.M)
        if count != 1:
            raise ForkError(f'{path}: found no line `{key} = "..."` to update')
    try:
        written = tomllib.loads(text)["upstream"]
    except (tomllib.TOMLDecodeError, KeyError) as err:
        raise ForkError(f"{path}: updating version and sha256 would leave it unreadable ({err!r})")
    if (written.get("version"), written.get("sha256")) != (pin.version, pin.sha256):
        raise ForkError(f"{path}: version and sha256 must be in its [upstream] table, one `key = \"value\"` a line")
    return text


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _hash_mismatch(what, expected, actual, sdist_name):
    return ForkError(f"sha256 mismatch for {what}:\n"
                     f"  expected {expected} (pinned in {PIN_FILE})\n"
                     f"  got      {actual}\n"
                     f"Refusing to build from an upstream source that is not the pinned {sdist_name}.")


def verify_sdist(pin, path):
    """Refuse any file but the pinned one, naming both hashes."""
    actual = sha256_of(path)
    if actual != pin.sha256:
        raise _hash_mismatch(path, pin.sha256, actual, pin.sdist_name)
    return path


def fetch_sdist(pin, dest, explicit=None):
    """Return the verified path of the pinned sdist, downloading it into ``dest`` if needed.

    ``explicit`` (or the DS_FORK_SDIST environment variable) names a local copy. Otherwise pip
    downloads it, so that pip's own index settings (PIP_INDEX_URL, PIP_FIND_LINKS, PIP_NO_INDEX,
    pip.conf) apply to mirrors and offline installs exactly as they do for any other package.
    """
    explicit = explicit or os.environ.get(SDIST_ENV)
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise ForkError(f"upstream sdist {path} (given by {SDIST_ENV} or the sdist config setting) does not exist")
        return verify_sdist(pin, path)

    # pip checks the pinned hash right after the download, before it prepares the sdist's metadata
    # (which runs its setup.py): a file that is not the pinned one never runs.
    path = download_sdist(
        pin.name,
        pin.version,
        dest,
        hint=f"Check pip's index settings, or point {SDIST_ENV} at a local copy of {pin.sdist_name}.",
        sha256=pin.sha256)
    return verify_sdist(pin, path)


def _setuptools_prepares_metadata():
    """Whether this interpreter's setuptools can prepare an sdist's wheel metadata: before 70.1 it needs the
    ``wheel`` package for that, which a plain ``python3 -m venv`` of Python 3.11 does not have."""
    if importlib.util.find_spec("setuptools") is None:
        return False
    if importlib.util.find_spec("wheel") is not None:
        return True
    version = importlib.metadata.version("setuptools").split(".")
    return tuple(int(part) for part in version[:2] if part.isdigit()) >= (70, 1)


def download_sdist(name, version, dest, hint, sha256=None):
    """Download ``name==version``'s sdist into ``dest`` with pip and return its path.

    With ``sha256`` (the pinned hash), pip runs in hash-checking mode: it refuses any other file
    before it prepares the sdist's metadata, so no code of an unpinned file runs. Without it (a new
    release whose hash is not known yet), the file is not verified and pip runs its setup.py.
    """
    dest = Path(dest)
    requirement, sdist_name = f"{name}=={version}", f"{name}-{version}.tar.gz"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--disable-pip-version-check"]
    if _setuptools_prepares_metadata():
        # pip prepares the sdist's metadata with the setuptools we already run under instead of
        # installing a second build environment (which needs the index again and fails offline).
        cmd.append("--no-build-isolation")
    cmd += ["-d", str(dest)]
    # When this runs inside pip's hook runner, its variables name *our* backend; the nested pip
    # would hand them on to the upstream sdist's setuptools backend and refuse to run it.
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PEP517_", "_PYPROJECT_HOOKS_"))}
    shown = ""
    with tempfile.TemporaryDirectory(prefix="deepspeed-fork-pin-") as tmp:
        if sha256 is None:
            cmd.append(requirement)
        else:
            requirements, line = Path(tmp) / "pinned-requirements.txt", f"{requirement} --hash=sha256:{sha256}"
            requirements.write_text(line + "\n")
            cmd += ["--require-hashes", "-r", str(requirements)]
            shown = f"  ({requirements.name}: {line})\n"
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    path = dest / sdist_name
    if proc.returncode != 0 or not path.is_file():
        if sha256 is not None:
            # pip's hash-mismatch report (pip keeps no file): "    <requirement> from <url> (from -r ...):",
            # then "        Expected sha256 <pinned>" and "             Got        <actual>".
            got = re.search(
                rf"(?:{re.escape(requirement)} from (\S+).*\n)?"
                rf"\s*Expected sha256 {sha256}\s*\n\s*Got\s+([0-9a-fA-F]{{64}})\s*$", proc.stdout, re.M)
            if got:
                source = got.group(1).rstrip(":") if got.group(1) else "the package index"
                raise _hash_mismatch(f"{sdist_name} from {source}", sha256, got.group(2).lower(), sdist_name)
        tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
        raise ForkError(f"could not fetch the upstream sdist {sdist_name} ({requirement}) with pip:\n"
                        f"  {' '.join(cmd)}\n{shown}{tail}\n{hint}")
    return path


def unpack_sdist(pin, sdist, dest):
    """Unpack the sdist into ``dest`` and return its top-level source directory."""
    dest = Path(dest)
    try:
        with tarfile.open(sdist) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(dest, filter="data")
            else:
                # Python before 3.11.4 has no extraction filters: refuse what the "data" filter refuses.
                for member in tar.getmembers():
                    name = Path(member.name)
                    if name.is_absolute() or ".." in name.parts or not (member.isfile() or member.isdir()):
                        raise tarfile.TarError(f"{member.name} is not a plain file or folder inside the archive")
                tar.extractall(dest)
    except (tarfile.TarError, OSError) as err:
        raise ForkError(f"{sdist}: cannot unpack the upstream sdist ({err})")
    tree = dest / f"{pin.name}-{pin.version}"
    if not (tree / "setup.py").is_file():
        raise ForkError(f"{sdist}: expected {tree.name}/setup.py inside the upstream sdist")
    return tree


@contextmanager
def removing_new_shm_segments():
    """Remove, after the block, the all-reduce segments that the DeepSpeed runs in it created: without the fork's
    fix each run of distributed tests leaves them in /dev/shm (memory) until the machine runs out of it."""
    before = set(SHM_DIR.glob(SHM_SEGMENT_GLOB))
    try:
        yield
    finally:
        for segment in set(SHM_DIR.glob(SHM_SEGMENT_GLOB)) - before:
            segment.unlink(missing_ok=True)


def make_workdir(prefix):
    """A fresh temporary directory outside any git work tree (git apply must not find one)."""
    return Path(tempfile.mkdtemp(prefix=prefix))


@dataclass(frozen=True)
class Release:
    """An upstream release and its verified sdist: every command and benchmark unpacks trees from here."""
    pin: Pin
    sdist: Path

    def tree(self, dest, patches=()):
        """The sdist unpacked under ``dest``, with ``patches`` (the series, part of it, or none) applied."""
        tree = unpack_sdist(self.pin, self.sdist, dest)
        apply_series(tree, patches)
        return tree

    def queue(self, dest):
        """The pristine sdist as a git repository at ``dest``: one commit, tagged ``upstream`` (a queue's base)."""
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        unpacked = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
        try:
            shutil.move(str(unpack_sdist(self.pin, self.sdist, unpacked)), str(dest))
        finally:
            shutil.rmtree(unpacked, ignore_errors=True)
        env = repo_env(dest)
        run_git(["init", "-q", "-b", "patch-queue"], dest, env)
        run_git(["add", "-A", "-f", "."], dest, env)
        run_git(["commit", "-q", "--no-verify", "-m", f"{self.pin.name} {self.pin.version} (pristine sdist)"], dest,
                dict(env, **_BASE_IDENTITY))
        run_git(["tag", BASE_TAG], dest, env)
        return dest


def pinned_release(repo, workdir, sdist=None):
    """The release ``repo`` pins, its sdist fetched into ``workdir`` (or ``sdist``, a local copy) and verified."""
    pin = read_pin(repo)
    return Release(pin, fetch_sdist(pin, Path(workdir) / "download", explicit=sdist))
