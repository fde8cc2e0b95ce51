"""Patch-queue workflow in the manner of ``gbp pq``.

``import`` materializes the patched upstream tree as a git repository: the pristine sdist as the
base commit (tagged ``upstream``), then one commit per patch, made with ``git am`` so that author,
date and message are the patch's own. Edit, rebase, add commits there, then ``export`` writes the
commits since ``upstream`` back into ``patches/`` and ``patches/series``. Export is byte-stable:
exporting an untouched queue rewrites no file.
"""

import email.utils
import shutil
from pathlib import Path

from forktools import ForkError
from forktools.files import write_files
from forktools.git import identity_env, repo_env, run_git
from forktools.series import LINKED_DIRS, PATCH_DIR, SERIES_FILE, linked_copy, read_series, series_names
from forktools.upstream import BASE_TAG, make_workdir, pinned_release

DEFAULT_QUEUE_DIR = Path("build") / "patch-queue"
# Every setting that changes format-patch's bytes is fixed here, so that the output does not
# depend on the maintainer's git configuration.
_FORMAT_PATCH = [
    "-c", "diff.algorithm=myers", "-c", "diff.noprefix=false", "-c", "diff.mnemonicPrefix=false", "-c",
    "diff.renames=true", "-c", "diff.relative=false", "-c", "diff.context=3", "-c", "diff.interHunkContext=0", "-c",
    "core.quotePath=true", "format-patch", "--zero-commit", "--no-signature", "--no-numbered", "--full-index",
    "--no-cover-letter", "--no-thread", "--subject-prefix=PATCH", "--stat=72", "--stat-graph-width=0",
    "--filename-max-length=80", "--no-notes", "--no-attach", "--no-base", "--encode-email-headers"
]


def import_queue(repo, queue, sdist=None, force=False):
    """Create ``queue`` as a git repository holding the pinned sdist plus one commit per patch."""
    repo, queue = Path(repo), Path(queue).resolve()
    if queue.exists():
        if not force:
            raise ForkError(f"{queue} already exists; export or discard it first (or pass --force to replace it)")
        shutil.rmtree(queue)
    patches = read_series(repo)
    workdir = make_workdir("deepspeed-fork-pq-")
    try:
        pinned_release(repo, workdir, sdist).queue(queue)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for patch in patches:
        proc = am_patch(queue, patch)
        if proc.returncode != 0:
            raise ForkError(f"{patch.name} does not apply in the queue at {queue}:\n{proc.stdout.strip()}\n"
                            "Resolve it there (git am --show-current-patch, fix, git add, git am --continue), "
                            "then export.")
    return queue


def am_patch(queue, patch):
    """Commit one patch onto the queue with ``git am``; returns the finished process (git am may have stopped)."""
    # The patch's author commits it too: the queue then needs no git identity configured,
    # and every import of the same series yields the same commit ids.
    name, address = email.utils.parseaddr(patch.author)
    am_env = dict(repo_env(queue), **identity_env(name, address, roles=("COMMITTER", )))
    return run_git(["am", "-q", "--no-3way", "--committer-date-is-author-date",
                    str(patch.path.resolve())],
                   queue,
                   am_env,
                   check=False)


def export_queue(repo, queue):
    """Write the queue's commits since ``upstream`` into patches/ and patches/series.

    Returns the names of the files that changed. Files of the old series that the queue no longer
    has are removed; files whose bytes are unchanged are not rewritten.
    """
    repo, queue = Path(repo), Path(queue).resolve()
    if not (queue / ".git").is_dir():
        raise ForkError(f"{queue} is not a patch queue (run `python -m forktools pq import` first)")
    if run_git(["status", "--porcelain", "--untracked-files=no"], queue, repo_env(queue)).stdout.strip():
        raise ForkError(f"{queue} has uncommitted changes; commit them (one commit per patch) before exporting")
    workdir = make_workdir("deepspeed-fork-export-")
    try:
        changes = patch_dir_changes(repo, format_patches(queue, workdir))
        write_files(repo, changes)
        return [Path(path).name for path in changes]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def format_patches(queue, outdir, since=BASE_TAG, linked_copies=True):
    """The queue's commits since ``since`` (default: ``upstream``) as patch files in ``outdir``, in order.

    With ``linked_copies``, each change to a file under csrc/ or op_builder/ is written to the sdist's copy
    of that file too (see ``LINKED_DIRS``), so that every patch gives the build's tree wherever the sdist is
    patched; upstream's layout (``prs``) has no copies.
    """
    head = with_linked_copies(queue, since) if linked_copies else "HEAD"
    run_git([*_FORMAT_PATCH, "-o", str(outdir), f"{since}..{head}"], queue, repo_env(queue))
    return sorted(Path(outdir).glob("*.patch"))


def with_linked_copies(queue, since):
    """The queue's commits since ``since``, each made again (same author, dates and message) with the sdist's
    copies of its csrc/ and op_builder/ files; returns the last one's id.

    A commit that already holds the copies is kept as it is, so an untouched queue exports its own commits.
    Only objects are written: no branch, index or file of the queue changes.
    """
    env = repo_env(queue)
    scratch_index = Path(queue) / ".git" / "forktools-linked-copies.index"
    index_env = dict(env, GIT_INDEX_FILE=str(scratch_index))

    def git(*args, in_env=env):
        return run_git(list(args), queue, in_env).stdout.strip()

    base = git("rev-parse", f"{since}^{{commit}}")
    parent = base
    try:
        for commit in git("rev-list", "--reverse", f"{since}..HEAD").split():
            git("read-tree", commit, in_env=index_env)
            for path in git("diff", "--name-only", "--no-renames", base, commit, "--", *LINKED_DIRS).splitlines():
                entry = git("ls-tree", commit, "--", path).split()
                if entry:
                    mode, _, blob = entry[:3]
                    git("update-index", "--add", "--cacheinfo", f"{mode},{blob},{linked_copy(path)}", in_env=index_env)
                else:
                    git("update-index", "--force-remove", "--", linked_copy(path), in_env=index_env)
            tree = git("write-tree", in_env=index_env)
            if tree == git("rev-parse", f"{commit}^{{tree}}") and parent == git("rev-parse", f"{commit}^"):
                parent = commit
                continue
            people = git("log", "-1", "--date=raw", "--format=%an%x00%ae%x00%ad%x00%cn%x00%ce%x00%cd", commit)
            author_name, author_email, author_date, name, email, date = people.split("\0")
            commit_env = dict(env, **identity_env(author_name, author_email, author_date, roles=("AUTHOR", )),
                              **identity_env(name, email, date, roles=("COMMITTER", )))
            # The message's bytes as they are: commit-tree takes them verbatim from a file.
            raw = run_git(["cat-file", "commit", commit], queue, env, binary=True).stdout
            message = scratch_index.with_suffix(".msg")
            message.write_bytes(raw.split(b"\n\n", 1)[1] if b"\n\n" in raw else b"")
            parent = git("commit-tree", tree, "-p", parent, "-F", str(message), in_env=commit_env)
    finally:
        scratch_index.unlink(missing_ok=True)
        scratch_index.with_suffix(".msg").unlink(missing_ok=True)
    return parent


def patch_dir_changes(repo, exported):
    """What writing ``exported`` as the series changes under patches/: {relative path: new bytes, or None to remove}.

    Patches come first (queue order), then removed files of the old series, then ``series``;
    files whose bytes are unchanged are left out.
    """
    patch_dir = Path(repo) / PATCH_DIR
    old = set(series_names(repo)) if (patch_dir / SERIES_FILE).is_file() else set()
    changes = {}
    for new in exported:
        target = patch_dir / new.name
        if not target.is_file() or target.read_bytes() != new.read_bytes():
            changes[f"{PATCH_DIR}/{new.name}"] = new.read_bytes()
    for name in sorted(old - {new.name for new in exported}):
        if (patch_dir / name).exists():
            changes[f"{PATCH_DIR}/{name}"] = None
    series_text = "".join(f"{new.name}\n" for new in exported).encode()
    series = patch_dir / SERIES_FILE
    if not series.is_file() or series.read_bytes() != series_text:
        changes[f"{PATCH_DIR}/{SERIES_FILE}"] = series_text
    return changes
