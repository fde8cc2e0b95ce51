"""Patch-queue workflow in the manner of ``gbp pq``.

``import`` materializes the patched upstream tree as a git repository: the pristine sdist as the
base commit (tagged ``upstream``), then one commit per patch, made with ``git am`` so that author,
date and message are the patch's own. Edit, rebase, add commits there, then ``export`` writes the
commits since ``upstream`` back into ``patches/`` and ``patches/series``. Export is byte-stable:
exporting an untouched queue rewrites no file.
"""

import email.utils
import os
import shutil
import subprocess
from pathlib import Path

from forktools import ForkError
from forktools.series import PATCH_DIR, SERIES_FILE, read_series, series_names
from forktools.upstream import fetch_sdist, make_workdir, read_pin, unpack_sdist

DEFAULT_QUEUE_DIR = Path("build") / "patch-queue"
BASE_TAG = "upstream"
# The base commit is made with a fixed identity and date so that every import of the same
# release yields the same commit ids.
_BASE_IDENTITY = {
    "GIT_AUTHOR_NAME": "upstream",
    "GIT_AUTHOR_EMAIL": "upstream@invalid",
    "GIT_COMMITTER_NAME": "upstream",
    "GIT_COMMITTER_EMAIL": "upstream@invalid",
    "GIT_AUTHOR_DATE": "1970-01-01T00:00:00+0000",
    "GIT_COMMITTER_DATE": "1970-01-01T00:00:00+0000",
}
# Every setting that changes format-patch's bytes is fixed here, so that the output does not
# depend on the maintainer's git configuration.
_FORMAT_PATCH = [
    "-c", "diff.algorithm=myers", "-c", "diff.noprefix=false", "-c", "diff.mnemonicPrefix=false", "-c",
    "diff.renames=true", "-c", "diff.relative=false", "-c", "diff.context=3", "-c", "diff.interHunkContext=0", "-c",
    "core.quotePath=true", "format-patch", "--zero-commit", "--no-signature", "--no-numbered", "--full-index",
    "--no-cover-letter", "--no-thread", "--subject-prefix=PATCH", "--stat=72", "--stat-graph-width=0",
    "--filename-max-length=80", "--no-notes", "--no-attach", "--no-base", "--encode-email-headers"
]


def _run(args, cwd, env=None, check=True):
    proc = subprocess.run(["git", *args],
                          cwd=cwd,
                          env=env,
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT,
                          text=True)
    if check and proc.returncode != 0:
        raise ForkError(f"git {' '.join(args)} failed in {cwd}:\n{proc.stdout.strip()}")
    return proc


def _queue_env(queue):
    # The queue is a repository of its own even when it lies inside the fork's checkout.
    return dict(os.environ, GIT_DIR=str(Path(queue) / ".git"), GIT_WORK_TREE=str(queue))


def import_queue(repo, queue, sdist=None, force=False):
    """Create ``queue`` as a git repository holding the pinned sdist plus one commit per patch."""
    repo, queue = Path(repo), Path(queue).resolve()
    if queue.exists():
        if not force:
            raise ForkError(f"{queue} already exists; export or discard it first (or pass --force to replace it)")
        shutil.rmtree(queue)
    pin = read_pin(repo)
    patches = read_series(repo)
    workdir = make_workdir("deepspeed-fork-pq-")
    try:
        tree = unpack_sdist(pin, fetch_sdist(pin, workdir / "download", explicit=sdist), workdir / "src")
        queue.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(tree), str(queue))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    env = _queue_env(queue)
    _run(["init", "-q", "-b", "patch-queue"], queue, env)
    _run(["add", "-A", "-f", "."], queue, env)
    _run(["commit", "-q", "--no-verify", "-m", f"{pin.name} {pin.version} (pristine sdist)"], queue,
         dict(env, **_BASE_IDENTITY))
    _run(["tag", BASE_TAG], queue, env)
    for patch in patches:
        # The patch's author commits it too: the queue then needs no git identity configured,
        # and every import of the same series yields the same commit ids.
        name, address = email.utils.parseaddr(patch.author)
        am_env = dict(env, GIT_COMMITTER_NAME=name, GIT_COMMITTER_EMAIL=address)
        proc = _run(["am", "-q", "--no-3way", "--committer-date-is-author-date",
                     str(patch.path.resolve())],
                    queue,
                    am_env,
                    check=False)
        if proc.returncode != 0:
            raise ForkError(f"{patch.name} does not apply in the queue at {queue}:\n{proc.stdout.strip()}\n"
                            "Resolve it there (git am --show-current-patch, fix, git add, git am --continue), "
                            "then export.")
    return queue


def export_queue(repo, queue):
    """Write the queue's commits since ``upstream`` into patches/ and patches/series.

    Returns the names of the files that changed. Files of the old series that the queue no longer
    has are removed; files whose bytes are unchanged are not rewritten.
    """
    repo, queue = Path(repo), Path(queue).resolve()
    if not (queue / ".git").is_dir():
        raise ForkError(f"{queue} is not a patch queue (run `python -m forktools pq import` first)")
    env = _queue_env(queue)
    if _run(["status", "--porcelain", "--untracked-files=no"], queue, env).stdout.strip():
        raise ForkError(f"{queue} has uncommitted changes; commit them (one commit per patch) before exporting")
    patch_dir = repo / PATCH_DIR
    workdir = make_workdir("deepspeed-fork-export-")
    try:
        _run([*_FORMAT_PATCH, "-o", str(workdir), f"{BASE_TAG}..HEAD"], queue, env)
        exported = sorted(workdir.glob("*.patch"))
        old = set(series_names(repo)) if (patch_dir / SERIES_FILE).is_file() else set()
        changed = []
        patch_dir.mkdir(exist_ok=True)
        for new in exported:
            target = patch_dir / new.name
            if not target.is_file() or target.read_bytes() != new.read_bytes():
                shutil.copyfile(new, target)
                changed.append(new.name)
        for name in sorted(old - {new.name for new in exported}):
            (patch_dir / name).unlink(missing_ok=True)
            changed.append(name)
        series_text = "".join(f"{new.name}\n" for new in exported)
        series = patch_dir / SERIES_FILE
        if not series.is_file() or series.read_text() != series_text:
            series.write_text(series_text)
            changed.append(SERIES_FILE)
        return changed
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
