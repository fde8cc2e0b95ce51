# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Refresh the series onto a new upstream release: ``python -m forktools refresh --to VERSION``.

The new release's sdist becomes the base of a patch queue (as ``pq import`` makes it) and the
series is replayed onto it one patch at a time, each one classified on the way:

- applies unchanged: every hunk applies exactly where the patch says;
- applies with offsets (refreshed): it applies, but hunks moved; its file is regenerated against
  the new base, exactly as ``pq export`` writes it;
- already in upstream: the patch reverse-applies to the new tree; it leaves the series and moves
  to ``patches/applied-upstream/`` with its ``Applied-Upstream:`` trailer set to the version;
- conflicts: the replay stops there with ``git am`` stopped on that patch in the queue.

Only a complete replay writes the repository: ``upstream.toml`` (new version, sha256 of the sdist),
``patches/series`` and the patch files, all or nothing. A conflict leaves the repository as it was
and the queue resumable: resolve, ``git am --continue``, then ``refresh --continue``.
"""

import json
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from forktools import ForkError
from forktools.files import replace_file, write_files
from forktools.git import repo_env, run_git
from forktools.pq import am_patch, format_patches, patch_dir_changes
from forktools.series import PATCH_DIR, explain_failure, local_version_label, read_series
from forktools.upstream import (BASE_TAG, PIN_FILE, Pin, Release, download_sdist, make_workdir, pin_file_text,
                                read_pin, sha256_of, verify_sdist)

UNCHANGED = "applies unchanged"
OFFSETS = "applies with offsets (refreshed)"
IN_UPSTREAM = "already in upstream"
CONFLICT = "conflicts"
RESOLVED = "conflict resolved in the queue (refreshed)"
SKIPPED = f"{IN_UPSTREAM} (skipped in the queue with git am --skip)"
APPLIED_UPSTREAM_DIR = "applied-upstream"
# What `refresh --continue` needs to know about a stopped refresh, kept inside the queue's .git.
STATE_FILE = "forktools-refresh.json"
# The paths a patch touches, old and new, from its diff headers.
_DIFF_PATHS_RE = re.compile(r"^diff --git a/(.+) b/(.+)$", re.M)
# git apply -v says this for every hunk that applies away from the line its header names.
_OFFSET_RE = re.compile(r"^Hunk #\d+ succeeded at \d+ \(offset -?\d+ lines?\)\.$", re.M)


@dataclass
class RefreshState:
    """A refresh under way: the new pin, and the outcome of each patch of the old series so far."""
    old_version: str
    name: str
    version: str
    sha256: str
    # Local version label of the series being refreshed: --continue refuses if patches/ changed since.
    series_label: str
    results: list = field(default_factory=list)  # [patch name, outcome], in series order
    pending: list = field(default_factory=list)  # names not replayed yet; a conflict stops at the first

    @property
    def pin(self):
        return Pin(name=self.name, version=self.version, sha256=self.sha256)

    def dropped(self):
        return [name for name, outcome in self.results if outcome.startswith(IN_UPSTREAM)]

    def kept(self):
        return [name for name, outcome in self.results if not outcome.startswith(IN_UPSTREAM)]


@dataclass
class Report:
    """What a refresh did, per patch, for a person; ``conflict`` is set when it stopped at one."""
    lines: list
    conflict: bool = False

    def __str__(self):
        return "\n".join(self.lines)


def run(repo, queue, version=None, sdist=None, force=False, dry_run=False, resume=False):
    """``refresh --to VERSION`` or ``refresh --continue``; returns the Report."""
    if resume:
        if sdist or force or dry_run:
            raise ForkError("refresh --continue takes only --dir: the release and its sdist were set by refresh --to")
        return resume_refresh(repo, queue)
    return refresh(repo, queue, version, sdist=sdist, force=force, dry_run=dry_run)


def refresh(repo, queue, version, sdist=None, force=False, dry_run=False):
    """Replay the series onto release ``version`` of upstream and, if every patch finds its place, re-pin.

    A dry run replays in a temporary queue and writes nothing. Otherwise the queue is left at
    ``queue``: refreshed, or stopped at the conflicting patch.
    """
    repo, queue = Path(repo), Path(queue).resolve()
    old_pin = read_pin(repo)
    patches = read_series(repo)
    if not dry_run and queue.exists() and not force:
        raise ForkError(f"{queue} already exists; export or discard it first (or pass --force to replace it)")
    workdir = make_workdir("deepspeed-fork-refresh-")
    try:
        # DS_FORK_SDIST names the *pinned* sdist, so only --sdist can stand in for the download here.
        if sdist:
            path = Path(sdist)
            if not path.is_file():
                raise ForkError(f"upstream sdist {path} (given by --sdist) does not exist")
        else:
            path = download_sdist(old_pin.name,
                                  version,
                                  workdir / "download",
                                  hint=f"Check pip's index settings, or pass --sdist with a local copy of "
                                  f"{old_pin.name}-{version}.tar.gz.",
                                  sha256=old_pin.sha256 if version == old_pin.version else None)
        if version == old_pin.version:
            verify_sdist(old_pin, path)  # the same release again: it has to be the very file pinned
        state = RefreshState(old_version=old_pin.version,
                             name=old_pin.name,
                             version=version,
                             sha256=sha256_of(path),
                             series_label=local_version_label(repo, patches),
                             pending=[patch.name for patch in patches])
        if dry_run:
            queue = workdir / "queue"
        elif queue.exists():
            shutil.rmtree(queue)
        Release(state.pin, path).queue(queue)
        header = [f"refresh {old_pin.name} {old_pin.version} -> {version} ({path.name}, sha256 {state.sha256})"]
        return _replay(repo, queue, state, {patch.name: patch for patch in patches}, dry_run, header)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def resume_refresh(repo, queue):
    """Go on with a refresh that stopped at a conflict, once ``git am`` in the queue has finished."""
    repo, queue = Path(repo), Path(queue).resolve()
    state_path = queue / ".git" / STATE_FILE
    if not state_path.is_file():
        raise ForkError(f"no stopped refresh in {queue} (start one with: python -m forktools refresh --to VERSION)")
    try:
        state = RefreshState(**json.loads(state_path.read_text()))
    except (ValueError, TypeError) as err:
        raise ForkError(f"{state_path}: unreadable ({err}); start the refresh again with --force")
    if not state.pending:
        raise ForkError(f"{state_path}: no patch left to continue with; start the refresh again with --force")
    current = state.pending[0]
    env = repo_env(queue)
    if (queue / ".git" / "rebase-apply").exists():
        raise ForkError(f"git am is still stopped at {current} in {queue}: finish it first (git am --continue, "
                        "or git am --skip if upstream has the change in another form)")
    if run_git(["status", "--porcelain", "--untracked-files=no"], queue, env).stdout.strip():
        raise ForkError(f"{queue} has uncommitted changes; commit them into the patch (git commit --amend) "
                        "or discard them (git checkout -- FILE) first")
    rejects = run_git(["ls-files", "--others", "--", "*.rej"], queue, env).stdout.split()
    if rejects:
        raise ForkError(f"{queue} still holds rejected hunks ({', '.join(rejects)}): merge what they hold "
                        "into the patch (or drop it), then delete the .rej files")
    patches = read_series(repo)
    if read_pin(repo).version != state.old_version or local_version_label(repo, patches) != state.series_label:
        raise ForkError(f"{PIN_FILE} or {PATCH_DIR}/ changed since the refresh stopped; start it again with "
                        f"python -m forktools refresh --to {state.version} --force")
    commits = int(run_git(["rev-list", "--count", f"{BASE_TAG}..HEAD"], queue, env).stdout)
    kept = len(state.kept())
    if commits == kept + 1:
        outcome = RESOLVED
    elif commits == kept:
        outcome = SKIPPED
    else:
        raise ForkError(f"{queue} has {commits} commits on top of '{BASE_TAG}'; the refresh expects {kept + 1} "
                        f"(one per patch kept so far, {current} included) or {kept} (if it was skipped)")
    state.results.append([current, outcome])
    state.pending.pop(0)
    header = [f"refresh {state.name} {state.old_version} -> {state.version} (continued, sha256 {state.sha256})"]
    return _replay(repo, queue, state, {patch.name: patch for patch in patches}, False, header)


def _replay(repo, queue, state, patches, dry_run, header):
    while state.pending:
        patch = patches[state.pending[0]]
        outcome, output = _replay_one(queue, patch)
        if outcome == CONFLICT:
            return _stop(queue, state, patch, output, dry_run, header)
        state.results.append([patch.name, outcome])
        state.pending.pop(0)
    return _finish(repo, queue, state, patches, dry_run, header)


def _replay_one(queue, patch):
    """Classify one patch against the queue's tree and commit it if it applies: (outcome, git apply's output)."""
    env = dict(repo_env(queue), LC_ALL="C")  # git's messages are parsed below
    check = ["apply", "--check", "-v", "--whitespace=nowarn"]
    # Reverse first: a patch whose lines upstream already has may still apply forward, at an
    # offset, and would add them a second time.
    if run_git([*check, "--reverse", str(patch.path.resolve())], queue, env, check=False).returncode == 0:
        return IN_UPSTREAM, ""
    forward = run_git([*check, str(patch.path.resolve())], queue, env, check=False)
    if forward.returncode != 0:
        return CONFLICT, forward.stdout
    proc = am_patch(queue, patch)
    if proc.returncode != 0:
        raise ForkError(f"{patch.name} passed git apply --check but git am failed in {queue}:\n{proc.stdout.strip()}")
    return (OFFSETS if _OFFSET_RE.search(forward.stdout) else UNCHANGED), forward.stdout


def _stop(queue, state, patch, output, dry_run, header):
    files, details = explain_failure(patch, output)
    lines = header + [f"  {name}: {outcome}" for name, outcome in state.results]
    lines.append(f"  {patch.name}: {CONFLICT} in {', '.join(files) or 'its target files'}")
    lines += ["  " + line for line in details]
    lines += [f"  {name}: not tried" for name in state.pending[1:]]
    if dry_run:
        lines.append(f"dry run: nothing written; without --dry-run the refresh stops at {patch.name}")
        return Report(lines, conflict=True)
    env = repo_env(queue)
    if am_patch(queue, patch).returncode == 0:
        raise ForkError(f"{patch.name} failed git apply --check but git am took it in {queue}")
    # git am applied none of it; stage the hunks that do apply and put the others in .rej files
    # beside their targets, so that what is left to merge is in plain sight. Staged, the partial
    # change is also undone by `git am --skip`.
    run_git(["apply", "--reject", "--whitespace=nowarn", str(patch.path.resolve())], queue, env, check=False)
    touched = sorted(
        {path
         for pair in _DIFF_PATHS_RE.findall(patch.path.read_text(encoding="utf-8"))
         for path in pair})
    tracked = set(run_git(["ls-files", "--", *touched], queue, env).stdout.splitlines())
    staged = [path for path in touched if path in tracked or (queue / path).exists()]
    if staged:
        run_git(["add", "-A", "--", *staged], queue, env)
    rejects = [f"{target}.rej" for target in files if (queue / f"{target}.rej").is_file()]
    replace_file(queue / ".git" / STATE_FILE, (json.dumps(asdict(state), indent=1) + "\n").encode())
    lines += [
        f"stopped at {patch.name}: {PIN_FILE} and {PATCH_DIR}/ are unchanged.",
        f"The queue at {queue} has {state.name} {state.version} as its base (tag '{BASE_TAG}') and the patches "
        f"before it; git am stopped on {patch.name}, with the hunks that apply staged" +
        (f" and the others in {', '.join(rejects)}." if rejects else "."),
        "Resolve there: merge the rejected hunks, delete the .rej files, git add, git am --continue (or, if upstream "
        "has the change in another form: git am --skip, delete the .rej files); then: "
        "python -m forktools refresh --continue",
    ]
    return Report(lines, conflict=True)


def _finish(repo, queue, state, patches, dry_run, header):
    """Write the refreshed series, the patches upstream has and the new pin, all or nothing."""
    kept, dropped = state.kept(), state.dropped()
    workdir = make_workdir("deepspeed-fork-refresh-export-")
    try:
        exported = format_patches(queue, workdir)
        if len(exported) != len(kept):
            raise ForkError(f"{queue} has {len(exported)} commits on top of '{BASE_TAG}', but the refresh kept "
                            f"{len(kept)} patches; start it again with --force")
        new_files = dict(zip(kept, exported))
        changes = patch_dir_changes(repo, exported)
        for name in dropped:
            target = f"{PATCH_DIR}/{APPLIED_UPSTREAM_DIR}/{name}"
            if (Path(repo) / target).exists():
                raise ForkError(f"{target} already exists; move it away, then refresh again (with --force)")
            changes[target] = mark_applied_upstream(patches[name].path.read_bytes(), state.version)
        pin_text = pin_file_text(repo, state.pin).encode()
        if pin_text != (Path(repo) / PIN_FILE).read_bytes():
            changes[PIN_FILE] = pin_text
        lines = header + [
            f"  {name}: {outcome}{_notes(name, outcome, patches, new_files, state)}" for name, outcome in state.results
        ]
        if dry_run:
            lines.append("dry run: nothing written; without --dry-run the refresh would:")
        else:
            write_files(repo, changes)
            (queue / ".git" / STATE_FILE).unlink(missing_ok=True)
            lines.append(f"refreshed onto {state.name} {state.version}; the queue at {queue} holds the new series. "
                         "Changed:")
        removed, wrote = ("remove", "write") if dry_run else ("removed", "wrote")
        lines += [f"  {removed if data is None else wrote} {path}" for path, data in changes.items()]
        lines += [] if changes else ["  (nothing to change)"]
        return Report(lines)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _notes(name, outcome, patches, new_files, state):
    if outcome.startswith(IN_UPSTREAM):
        return f" -> {PATCH_DIR}/{APPLIED_UPSTREAM_DIR}/{name} (Applied-Upstream: {state.version})"
    new = new_files[name]
    notes = []
    if new.name != name:
        notes.append(f"now {new.name}")
    old_bytes, new_bytes = patches[name].path.read_bytes(), new.read_bytes()
    if outcome == UNCHANGED and old_bytes != new_bytes:
        # Upstream changed the file elsewhere: the hunks stand, the blob ids in the index lines do not.
        same_hunks = _without_index_lines(old_bytes) == _without_index_lines(new_bytes)
        notes.append("index lines refreshed" if same_hunks else "regenerated")
    return f" ({', '.join(notes)})" if notes else ""


def _without_index_lines(data):
    return [line for line in data.splitlines() if not line.startswith(b"index ")]


def mark_applied_upstream(patch_bytes, version):
    """The patch with its ``Applied-Upstream:`` trailer set to ``version`` (added before the sign-off if missing)."""
    text = patch_bytes.decode("utf-8")
    message, sep, rest = text.partition("\n---\n")
    if not sep:
        raise ForkError("not a git format-patch file (no --- line after the commit message)")
    trailer = f"Applied-Upstream: {version}"
    found = list(re.finditer(r"^Applied-Upstream:.*$", message, flags=re.M))
    if found:
        last = found[-1]  # the trailer block is last; an earlier match would be prose
        message = message[:last.start()] + trailer + message[last.end():]
    else:
        message, count = re.subn(r"^(?=Signed-off-by:)", trailer + "\n", message, count=1, flags=re.M)
        if not count:
            message += "\n" + trailer
    return (message + sep + rest).encode("utf-8")
