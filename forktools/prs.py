# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The series as upstream pull requests: ``python -m forktools prs [--out DIR]``.

A topic is one upstream pull request: the patches whose header says ``Topic: NAME`` (a patch with
no Topic is a topic of its own; fork-only patches, ``Forwarded: not-needed``, are not exported),
plus the test files their ``Upstream-Tests:`` fields name, at the same paths upstream keeps them
(our ``tests/`` mirrors upstream's layout). ``Depends-On: TOPIC`` says which topics must be merged
first for the tests to pass.

For each topic, in series order, ``DIR/NN-TOPIC/`` gets:

- ``TOPIC.mbox``: one commit per patch, then one commit adding the tests, as ``git format-patch``
  writes them; ``git am TOPIC.mbox`` applies it to a repository of the pristine upstream release
  (after the mailboxes of the topics it depends on). The fork's own header fields are left out,
  and so are the sdist's copies of csrc/ and op_builder/ files (links in upstream's repository).
  Every commit keeps its author's DCO sign-off and gets, after it, the sign-off of the person who
  exports it (git's user.name and user.email; the export refuses to run without them).
- ``PR.md``: the pull request's title and description (symptom, root cause and fix from each
  patch's message; how it was verified; what it depends on; who signed it off).
- ``upstream-test-updates.patch``, for a topic that changes behaviour an upstream test asserts: the
  update of that test, with the reason (``patches/upstream-tests/TOPIC.patch``). It changes
  upstream's ``tests/``, which the sdist does not hold, so ``git am`` it after the mailbox in a
  clone of upstream's repository; ``python -m forktools upstream-tests`` runs the fork with it.

Every mailbox is checked while it is made: the topics are applied in series order to one pristine
repository, and each topic without dependencies also alone to a fresh one.
"""

import email.utils
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from forktools import ForkError
from forktools.git import configured_identity, identity_env, repo_env, run_git
from forktools.pq import am_patch, format_patches
from forktools.series import (DEP3_FIELDS, EXPORT_FIELDS, README_FIELDS, TEST_UPDATES_DIR, TOPIC_KINDS, LINKED_DIRS,
                              linked_copy, linked_original, parse_patch, read_series, without_fields)
from forktools.upstream import BASE_TAG, make_workdir, pinned_release, removing_new_shm_segments

DEFAULT_OUT_DIR = Path("build") / "upstream-prs"
# Header fields that only mean something to the fork; the mailbox leaves them out.
_FORK_ONLY_FIELDS = tuple(name for name in DEP3_FIELDS + EXPORT_FIELDS + README_FIELDS
                          if name not in ("Bug", "Origin"))
# A topic's tests, run twice by --verify, each time within this (a hung run is a failure, not a hang).
VERIFY_TIMEOUT_S = 1800
# Where a topic's update of upstream tests goes beside its mailbox.
TEST_UPDATES_FILE = "upstream-test-updates.patch"


@dataclass
class Topic:
    name: str
    kind: str = None
    patches: list = field(default_factory=list)
    tests: list = field(default_factory=list)
    depends_on: list = field(default_factory=list)
    test_updates: Path = None


def topics_of(repo, patches):
    """The series' topics in series order (by their first patch), checking their fields."""
    topics = {}
    for patch in patches:
        if patch.fork_only:
            continue
        topic = topics.setdefault(patch.topic, Topic(patch.topic, patch.dep3.get("Kind")))
        if patch.dep3.get("Kind") not in TOPIC_KINDS or patch.dep3["Kind"] != topic.kind:
            raise ForkError(f"{patch.name}: Kind: must be one of {', '.join(TOPIC_KINDS)} (a fix of a bug of the "
                            f"release, or a feature), the same for every patch of topic {topic.name}; found "
                            f"{patch.dep3.get('Kind')!r}")
        topic.patches.append(patch)
        # Several patches of one topic may name the same test file; the topic adds it once.
        topic.tests += [test for test in patch.dep3.get("Upstream-Tests", "").split() if test not in topic.tests]
        topic.depends_on += [dep for dep in patch.dep3.get("Depends-On", "").split() if dep not in topic.depends_on]
    for topic in topics.values():
        for dep in topic.depends_on:
            if dep not in topics:
                raise ForkError(f"topic {topic.name} depends on {dep!r}, which no patch of the series names as its "
                                f"Topic (known topics: {', '.join(topics)})")
    for update in sorted((Path(repo) / TEST_UPDATES_DIR).glob("*.patch")):
        if update.stem not in topics:
            raise ForkError(f"{TEST_UPDATES_DIR / update.name} is named after no topic of the series "
                            f"(known topics: {', '.join(topics)})")
        topics[update.stem].test_updates = update
    owners = {}
    for topic in topics.values():
        for test in topic.tests:
            if test in owners:
                # Two pull requests adding the same file would not apply one after the other.
                raise ForkError(f"{test} is listed by topics {owners[test]} and {topic.name}; a test file "
                                "goes upstream with one topic")
            owners[test] = topic.name
    return list(topics.values())


def dependencies(topic, topics):
    """The topics that must be merged before ``topic``, its dependencies' dependencies included, in series order."""
    by_name = {other.name: other for other in topics}
    needed, pending = set(), list(topic.depends_on)
    while pending:
        name = pending.pop()
        if name not in needed:
            needed.add(name)
            pending += by_name[name].depends_on
    return [other for other in topics if other.name in needed]


def fixes_not_standalone(topics):
    """What keeps fix topics from going upstream on their own: a fix must come before every feature in the
    series and need at most one other topic merged first, itself a fix."""
    problems = []
    first_feature = next((topic for topic in topics if topic.kind == "feature"), None)
    for index, topic in enumerate(topics):
        if topic.kind != "fix":
            continue
        needed = dependencies(topic, topics)
        if first_feature and index > topics.index(first_feature):
            problems.append(f"fix topic {topic.name} comes after feature topic {first_feature.name}")
        if len(needed) > 1 or any(dep.kind != "fix" for dep in needed):
            problems.append(f"fix topic {topic.name} needs {len(needed)} topic(s) merged first: " +
                            ", ".join(f"{dep.name} ({dep.kind})" for dep in needed))
    return problems


def exporter_signoff(repo):
    """``Name <email>`` of the person exporting, from git's user.name and user.email, for their DCO sign-off."""
    name, address = configured_identity(repo)
    if not name or not address:
        missing = [key for key, value in (("user.name", name), ("user.email", address)) if not value]
        verb = "are" if len(missing) > 1 else "is"
        raise ForkError(f"forktools prs signs off every exported commit as you (upstream's DCO), from git's "
                        f"user.name and user.email, and {' and '.join(missing)} {verb} not set. Set your own "
                        "identity, e.g.\n"
                        "  git config --global user.name 'Your Name'\n"
                        "  git config --global user.email you@example.com")
    return f"{name} <{address}>"


def signed_off(message, signer):
    """A commit message (or a patch mail's head) whose trailers end with ``Signed-off-by: signer``.

    The author's sign-off stays: upstream's DCO check wants one that matches the commit's author, and the
    person who passes the change on adds theirs after it.
    """
    lines = message.rstrip("\n").split("\n")
    signoff = f"Signed-off-by: {signer}"
    if any(line.strip().lower() == signoff.lower() for line in lines):
        return message
    last = max((i for i, line in enumerate(lines) if line.startswith("Signed-off-by:")), default=None)
    if last is None:
        lines += ["", signoff]
    else:
        lines.insert(last + 1, signoff)
    return "\n".join(lines) + message[len(message.rstrip("\n")):]


def mailbox_message(patch, signer):
    """The patch file for ``git am`` onto upstream: without the fork-only header fields, signed off by
    ``signer``, and in upstream's layout, where deepspeed/ops/csrc and deepspeed/ops/op_builder are links to
    csrc/ and op_builder/ (the patch's changes to the sdist's copies are left out)."""
    text = patch.path.read_text(encoding="utf-8")
    head, sep, diff = text.partition("\n---\n")
    kept = without_fields(head.split("\n"), _FORK_ONLY_FIELDS)
    return signed_off("\n".join(kept), signer) + sep + upstream_layout(patch, diff)


def upstream_layout(patch, diff):
    """``diff`` (a patch's diffstat and diffs) without the diffs of the sdist's copies of linked files."""
    sections = re.split(r"(?m)^(?=diff --git )", diff)
    paths = [re.match(r"diff --git a/\S+ b/(\S+)", section) for section in sections]
    changed = {match.group(1) for match in paths if match}
    kept = []
    for section, match in zip(sections, paths):
        original = linked_original(match.group(1)) if match else None
        if original is None:
            kept.append(section)
        elif original not in changed:
            raise ForkError(f"{patch.name} changes {match.group(1)} but not {original}: in upstream's repository the "
                            f"first is a link to the second; change {original} in the patch queue")
    return "".join(kept)


def signed_test_updates(path, signer):
    """A topic's update of upstream tests (a patch mail), signed off by ``signer`` too."""
    head, sep, diff = Path(path).read_text(encoding="utf-8").partition("\n---\n")
    return signed_off(head, signer) + sep + diff


def commit_topic(queue, topic, repo, scratch, signer):
    """Apply ``topic``'s patches and commit its tests in ``queue``, signed off by ``signer`` too; the commits'
    range start is returned."""
    start = run_git(["rev-parse", "HEAD"], queue, repo_env(queue)).stdout.strip()
    for patch in topic.patches:
        stripped = scratch / patch.name
        stripped.write_text(mailbox_message(patch, signer), encoding="utf-8")
        proc = am_patch(queue, replace(patch, path=stripped))
        if proc.returncode != 0:
            raise ForkError(f"topic {topic.name}: {patch.name} does not apply with git am on the pristine upstream "
                            f"release (after the topics before it):\n{proc.stdout.strip()}")
    if topic.tests:
        for test in topic.tests:
            target = queue / test
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(repo) / test, target)
        author = topic.patches[-1].author
        name, address = email.utils.parseaddr(author)
        env = dict(repo_env(queue), **identity_env(name, address))
        run_git(["add", "-f", *topic.tests], queue, env)
        message = (f"tests: {topic.patches[0].subject}\n\n"
                   f"Tests for this change, in DeepSpeed's DistributedTest style:\n\n" +
                   "".join(f"- {test}\n"
                           for test in topic.tests) + signed_off(f"\nSigned-off-by: {name} <{address}>\n", signer))
        run_git(["commit", "-q", "--no-verify", "-m", message], queue, env)
    return start


def pr_description(topic, topics_dir_names, signer):
    """PR.md: the title, each patch's message (symptom, root cause, fix), verification, dependencies, sign-off."""
    lines = [f"# {topic.patches[0].subject}", ""]
    for patch in topic.patches:
        # The message holds the body only (the subject is a header of the patch file).
        body = "\n".join(without_fields(
            patch.message.strip("\n").split("\n"), _FORK_ONLY_FIELDS + ("Signed-off-by", )))
        if len(topic.patches) > 1:
            lines += [f"## {patch.subject}", ""]
        lines += [body.strip("\n"), ""]
    lines += ["## Verification", ""]
    if topic.tests:
        lines += ["New tests (each fails on the release without this change):", ""]
        lines += [f"- `{test}`" for test in topic.tests]
        lines += [
            "", "```bash", "cd tests && pytest " + " ".join(str(Path(t).relative_to("tests")) for t in topic.tests),
            "```", ""
        ]
    else:
        lines += ["Covered by the tests of the other commits of this pull request.", ""]
    if topic.test_updates:
        update = parse_patch(topic.test_updates)
        files = re.findall(r"^diff --git a/(\S+) ", topic.test_updates.read_text(encoding="utf-8"), re.M)
        body = "\n".join(line for line in update.message.strip("\n").split("\n")
                         if not line.startswith("Signed-off-by:")).strip("\n")
        lines += ["## Upstream tests this changes", "", f"{update.subject}: " + ", ".join(f"`{f}`" for f in files), ""]
        lines += [body, "", f"The update is `{TEST_UPDATES_FILE}` (`git am` it after the mailbox).", ""]
    if topic.depends_on:
        lines += ["## Depends on", ""]
        lines += [
            f"- {dep} (`{topics_dir_names[dep]}/PR.md`): its fix is needed for these tests to pass"
            for dep in topic.depends_on
        ]
        lines.append("")
    lines += [
        "## Sign-off", "", f"Every commit carries its author's `Signed-off-by:` and, after it, that of {signer}, "
        "who exported it from the fork and submits it (DCO).", ""
    ]
    return "\n".join(lines)


def apply_mailbox(queue, mailbox):
    """``git am`` a topic's mailbox onto ``queue``; returns the finished process (git am may have stopped)."""
    env = dict(repo_env(queue), **identity_env("prs", "prs@invalid", roles=("COMMITTER", )))
    return run_git(["am", "-q", "--no-3way", str(mailbox)], queue, env, check=False)


def export_topics(repo, out_dir, sdist=None):
    """Write every topic's mailbox and PR description under ``out_dir``; returns [(topic, its dir)]."""
    repo, out_dir = Path(repo), Path(out_dir)
    signer = exporter_signoff(repo)
    topics = topics_of(repo, read_series(repo))
    for topic in topics:
        for test in topic.tests:
            if not (repo / test).is_file():
                raise ForkError(f"topic {topic.name}: Upstream-Tests names {test}, which does not exist")
    dir_names = {topic.name: f"{index:02d}-{topic.name}" for index, topic in enumerate(topics, start=1)}
    workdir = make_workdir("deepspeed-fork-upstream-prs-")
    try:
        release = pinned_release(repo, workdir, sdist)
        scratch = workdir / "scratch"
        scratch.mkdir()
        staging = workdir / "out"
        # All topics in series order, on one repository: the mailboxes come from here.
        in_order = release.queue(workdir / "in-series-order")
        for topic in topics:
            start = commit_topic(in_order, topic, repo, scratch, signer)
            topic_dir = staging / dir_names[topic.name]
            topic_dir.mkdir(parents=True)
            commits = format_patches(in_order, scratch / f"{topic.name}-commits", since=start, linked_copies=False)
            mailbox = b"".join(path.read_bytes() for path in commits)
            (topic_dir / f"{topic.name}.mbox").write_bytes(mailbox)
            (topic_dir / "PR.md").write_text(pr_description(topic, dir_names, signer), encoding="utf-8")
            if topic.test_updates:
                (topic_dir / TEST_UPDATES_FILE).write_text(signed_test_updates(topic.test_updates, signer),
                                                           encoding="utf-8")
        # Topics that depend on nothing must apply alone too, and a fix after only the topics it depends on:
        # each on the pristine release, which one repository returns to between them.
        alone = release.queue(workdir / "alone")
        for topic in topics:
            needed = dependencies(topic, topics)
            if needed and (topic.kind != "fix" or len(needed) > 1):
                continue
            run_git(["reset", "-q", "--hard", BASE_TAG], alone, repo_env(alone))
            for dep in needed + [topic]:
                proc = apply_mailbox(alone, staging / dir_names[dep.name] / f"{dep.name}.mbox")
                if proc.returncode != 0:
                    after = f" after {needed[0].name}" if needed else ""
                    raise ForkError(f"topic {topic.name} does not apply{after} alone on the pristine upstream "
                                    f"release:\n{proc.stdout.strip()}")
        # Replace the output only when everything was made and checked.
        if out_dir.exists():
            shutil.rmtree(out_dir)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staging), str(out_dir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return [(topic, out_dir / dir_names[topic.name]) for topic in topics]


def run_topic_tests(repo, topic, tree, env):
    """Run ``topic``'s test files (not the helpers it adds) with ``tree`` first on the path; (passed, summary)."""
    tests = [test for test in topic.tests if Path(test).name.startswith("test_")]
    try:
        with removing_new_shm_segments():
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                                  cwd=repo,
                                  env=dict(env, PYTHONPATH=str(tree)),
                                  stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT,
                                  text=True,
                                  timeout=VERIFY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False, f"no result within {VERIFY_TIMEOUT_S} s"
    counts = re.findall(r"^=* ?(\d+ (?:passed|failed|errors?|skipped)\b.*?)(?: in [\d.]+s.*)? ?=*$", proc.stdout, re.M)
    return proc.returncode == 0, (counts[-1] if counts else f"pytest exited {proc.returncode}")


def verify_topics(repo, exported, sdist=None, names=(), log=lambda line: print(line, flush=True)):
    """Run each fix topic's tests (or those of the topics ``names``) on the pristine release plus the topics it
    depends on, without the topic, where they must fail, and with it, where they must pass; what was found goes
    into its PR.md. Returns the topics for which it did not hold."""
    topics = [topic for topic, _ in exported]
    dirs = {topic.name: topic_dir for topic, topic_dir in exported}
    unknown = set(names) - set(dirs)
    if unknown:
        raise ForkError(f"no topic named {', '.join(sorted(unknown))} (known topics: {', '.join(dirs)})")
    chosen = [topic for topic in topics if (topic.name in names if names else topic.kind == "fix")]
    workdir = make_workdir("deepspeed-fork-verify-")
    failed = []
    try:
        # One tree at one path for every run: the JIT-built ops are built again only when a topic changes them.
        release = pinned_release(repo, workdir, sdist)
        tree = release.queue(workdir / "deepspeed")
        env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(workdir / "torch-extensions"))
        for topic in chosen:
            if not any(Path(test).name.startswith("test_") for test in topic.tests):
                log(f"{topic.name}: has no test of its own to verify")
                failed.append(topic)
                continue
            needed = dependencies(topic, topics)
            base = " + ".join([release.pin.version] + [dep.name for dep in needed])
            if not apply_topics(tree, needed + [topic], dirs):
                # Its mailbox was made after every topic before it; where it does not apply after its
                # dependencies alone, the base is all of those.
                needed = topics[:topics.index(topic)]
                base = f"{release.pin.version} + the {len(needed)} topics before it"
            if not apply_topics(tree, needed, dirs):
                raise ForkError(f"the topics before {topic.name} do not apply in series order")
            base_passed, base_summary = run_topic_tests(repo, topic, tree, env)
            if not apply_topics(tree, [topic], dirs, reset=False):
                raise ForkError(f"topic {topic.name} does not apply after {base}")
            passed, summary = run_topic_tests(repo, topic, tree, env)
            verdict = (f"fails on {base} ({base_summary}), "
                       if not base_passed else f"PASSES on {base} ({base_summary}), ")
            verdict += f"passes with this PR ({summary})" if passed else f"FAILS with this PR ({summary})"
            log(f"{topic.name}: {verdict}")
            if base_passed or not passed:
                failed.append(topic)
            record_verification(dirs[topic.name] / "PR.md", topic, verdict)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return failed


def apply_topics(tree, topics, dirs, reset=True):
    """``git am`` the mailboxes of ``topics`` in order onto ``tree``, from the pristine release unless not
    ``reset``; whether they all applied."""
    if reset:
        run_git(["reset", "-q", "--hard", BASE_TAG], tree, repo_env(tree))
        run_git(["clean", "-q", "-fdx"], tree, repo_env(tree))
    for topic in topics:
        proc = apply_mailbox(tree, dirs[topic.name] / f"{topic.name}.mbox")
        if proc.returncode != 0:
            run_git(["am", "--abort"], tree, repo_env(tree), check=False)
            return False
        sync_linked_copies(tree)
    return True


def sync_linked_copies(tree):
    """Bring the sdist's copies under deepspeed/ops/ in line with csrc/ and op_builder/, which the mailboxes change
    (in upstream's repository they are links); unchanged files keep their times, so nothing is rebuilt for them."""
    for linked in LINKED_DIRS:
        for original in sorted((tree / linked).rglob("*")):
            copy = tree / linked_copy(str(original.relative_to(tree)))
            if original.is_file() and (not copy.is_file() or copy.read_bytes() != original.read_bytes()):
                copy.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(original, copy)


def record_verification(pr_file, topic, verdict):
    """Add what the verification found to the Verification section of a topic's PR.md."""
    text = pr_file.read_text(encoding="utf-8")
    head, sep, rest = text.partition("\n## Depends on\n") if topic.depends_on else text.partition("\n## Sign-off\n")
    tests = ", ".join(f"`{Path(test).name}`" for test in topic.tests if Path(test).name.startswith("test_"))
    note = f"Verified (`python -m forktools prs --verify`): {tests} {verdict}.\n"
    pr_file.write_text(f"{head.rstrip(chr(10))}\n\n{note}{sep}{rest}", encoding="utf-8")
