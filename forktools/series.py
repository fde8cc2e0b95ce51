"""The patch series: reading ``patches/series`` and the patch headers, and applying it to a tree."""

import email
import email.policy
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

from forktools import ForkError
from forktools.git import plain_tree_env, run_git

PATCH_DIR = "patches"
SERIES_FILE = "series"
# A topic that changes behaviour an upstream test asserts keeps that test's update here, as TOPIC.patch
# (a git format-patch mail against upstream's tests/, which the sdist does not hold).
TEST_UPDATES_DIR = Path(PATCH_DIR) / "upstream-tests"
# DEP-3 fields recorded in each patch's commit message, next to its Signed-off-by trailer.
DEP3_FIELDS = ("Forwarded", "Applied-Upstream", "Bug", "Origin", "Last-Update")
# The fork's own header fields, for the upstream pull requests (forktools/prs.py): the topic (upstream
# pull request) a patch belongs to, whether that topic fixes a bug of the release or adds a feature
# (``Kind: fix`` or ``Kind: feature``), the topics its tests need first, and the tests that go with it.
EXPORT_FIELDS = ("Topic", "Kind", "Depends-On", "Upstream-Tests")
TOPIC_KINDS = ("fix", "feature")
# The fork's own docs: what the patch fixes, in its row of docs/topics.md (python -m forktools readme).
# A long value goes on over the lines after it that start with a space, as in any trailer.
README_FIELDS = ("Summary", )
FIELDS = DEP3_FIELDS + EXPORT_FIELDS + README_FIELDS

_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+\d+(?:,(\d+))? @@")


@dataclass
class Patch:
    path: Path
    subject: str
    author: str
    message: str
    dep3: dict = field(default_factory=dict)

    @property
    def name(self):
        return self.path.name

    @property
    def topic(self):
        """The upstream pull request it belongs to: its Topic field, or a topic of its own named after it."""
        return self.dep3.get("Topic") or re.sub(r"^\d+-|\.patch$", "", self.name)

    @property
    def fork_only(self):
        return self.dep3.get("Forwarded", "no") == "not-needed"

    def summary(self):
        """What an installed build reports about this patch."""
        return {
            "name": self.name,
            "subject": self.subject,
            "forwarded": self.dep3.get("Forwarded", "no"),
            "applied_upstream": self.dep3.get("Applied-Upstream", "no"),
        }


def series_names(repo):
    """Patch file names in series order (blank lines and ``#`` comments skipped)."""
    series = Path(repo) / PATCH_DIR / SERIES_FILE
    if not series.is_file():
        raise ForkError(f"{series}: the patch series file is missing")
    names = []
    for line in series.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line)
    return names


def parse_patch(path):
    """Read a ``git format-patch`` file: subject, author, commit message and DEP-3 fields."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    msg = email.message_from_string(text, policy=email.policy.default)
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", str(msg.get("Subject", ""))).strip()
    if not subject or msg.get("From") is None:
        raise ForkError(f"{path}: not a git format-patch file (no From:/Subject: header)")
    body = msg.get_payload()
    message = body.split("\n---\n", 1)[0].strip("\n")
    dep3 = {}
    key = None
    for line in message.splitlines():
        if key and line[:1] == " ":
            dep3[key] = f"{dep3[key]} {line.strip()}"
            continue
        key, sep, value = line.partition(":")
        if sep and key in FIELDS:
            dep3[key] = value.strip()
        else:
            key = None
    return Patch(path=path, subject=subject, author=str(msg["From"]), message=message, dep3=dep3)


def without_fields(lines, fields):
    """The lines of a commit message without the ``fields`` (each with the lines that continue it)."""
    kept, dropping = [], False
    for line in lines:
        if dropping and line[:1] == " ":
            continue
        dropping = line.partition(":")[0] in fields
        if not dropping:
            kept.append(line)
    return kept


def read_series(repo):
    """The series as parsed patches, checking that every listed file exists."""
    patch_dir = Path(repo) / PATCH_DIR
    patches = []
    for name in series_names(repo):
        path = patch_dir / name
        if not path.is_file():
            raise ForkError(f"{patch_dir / SERIES_FILE} lists {name}, but {path} does not exist")
        patches.append(parse_patch(path))
    return patches


def series_digest(repo, patches):
    """A short digest of the series file and every patch in it, for the version's local label."""
    digest = hashlib.sha256((Path(repo) / PATCH_DIR / SERIES_FILE).read_bytes())
    for patch in patches:
        digest.update(patch.path.read_bytes())
    return digest.hexdigest()[:8]


def local_version_label(repo, patches):
    """``fork.<number of patches>.<series digest>``: PEP 440 local label, so ``==0.19.8`` still matches."""
    return f"fork.{len(patches)}.{series_digest(repo, patches)}"


@dataclass
class Hunk:
    """One hunk of a unified diff (a patch file, or a tool's ``--diff`` output)."""
    target: str  # the b/ side of the file's "diff --git" line; None in a plain unified diff
    source: str  # the name on the file's "--- " line, without a tab-separated suffix
    number: int  # its place among the hunks of its file, from 1
    line: int  # line number (from 1) of its "@@" header in the diff
    old_start: int  # the first line of the original file it covers
    lines: list  # the "@@" header, then the body


def diff_hunks(lines):
    """Every hunk of a unified diff given as its lines, in order."""
    target = source = None
    number, i = 0, 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("diff --git "):
            target, source, number = line.split(" b/", 1)[-1], None, 0
        elif line.startswith("--- "):
            source = line[4:].rsplit("\t", 1)[0]
        match = _HUNK_RE.match(line)
        if not match:
            i += 1
            continue
        # The header's line counts say where the hunk ends (a body line may itself look like "-- " or "--- ").
        old_left, new_left = int(match.group(2) or 1), int(match.group(3) or 1)
        number, end = number + 1, i + 1
        while end < len(lines) and (old_left > 0 or new_left > 0 or lines[end].startswith("\\")):
            tag = lines[end][:1]
            old_left -= tag in (" ", "-", "")
            new_left -= tag in (" ", "+", "")
            end += 1
        yield Hunk(target, source, number, i + 1, int(match.group(1)), lines[i:end])
        i = end


def hunks(patch_path):
    """Every hunk of a patch file."""
    return diff_hunks(Path(patch_path).read_text(encoding="utf-8").splitlines())


def _failed_hunk(patch_path, target, old_start):
    return next((hunk for hunk in hunks(patch_path) if hunk.target == target and hunk.old_start == old_start), None)


def apply_patch(tree, patch):
    """Apply one patch to an unpacked tree, all or nothing, or explain which hunk of which file failed."""
    tree = Path(tree).resolve()
    proc = run_git(["apply", "--whitespace=nowarn", str(patch.path)], tree, plain_tree_env(tree), check=False)
    if proc.returncode == 0:
        return
    _, details = explain_failure(patch, proc.stdout)
    raise ForkError(
        f"patch {patch.name} does not apply to {tree.name}:\n" + "\n".join(details) +
        "\nRefresh the patch against the pinned upstream (python -m forktools pq import; see docs/maintainers.md).")


def explain_failure(patch, git_apply_output):
    """From ``git apply``'s errors: (the files that do not take the patch, lines naming each failing hunk)."""
    files, details = [], []
    for line in git_apply_output.splitlines():
        failed = re.match(r"error: patch failed: (.+):(\d+)$", line)
        missing = re.match(r"error: (.+): (No such file or directory|does not exist in index)$", line)
        present = re.match(r"error: (.+): already exists in (working directory|index)$", line)
        if failed:
            target = failed.group(1)
            files.append(target)
            details.append(f"  target file: {target}")
            hunk = _failed_hunk(patch.path, target, int(failed.group(2)))
            if hunk:
                details.append(f"  failing hunk: #{hunk.number} in {target} (line {hunk.line} of the patch):")
                details.extend("    " + hunk_line for hunk_line in hunk.lines)
        elif missing:
            files.append(missing.group(1))
            details.append(f"  target file: {missing.group(1)} (missing from the upstream tree)")
        elif present:
            files.append(present.group(1))
            details.append(f"  target file: {present.group(1)} (the patch creates it, but the upstream tree has it)")
    if not details:
        details = ["  " + line for line in git_apply_output.strip().splitlines()]
    return list(dict.fromkeys(files)), details


def apply_series(tree, patches):
    for patch in patches:
        apply_patch(tree, patch)
        check_linked_copies(tree, patch)


# In upstream's repository deepspeed/ops/csrc and deepspeed/ops/op_builder are symbolic links to the
# top-level csrc/ and op_builder/; the sdist holds copies, and the wheel installs the copies. A patch
# changes both, so that it gives the build's tree wherever it is applied to the sdist: `pq export`
# writes the copies (forktools/pq.py), `prs` leaves them out again for upstream (forktools/prs.py).
LINKED_DIRS = ("csrc", "op_builder")
LINKED_COPIES_DIR = "deepspeed/ops"


def linked_copy(path):
    """The sdist's copy of ``path`` (a file under csrc/ or op_builder/), or None for any other file."""
    return f"{LINKED_COPIES_DIR}/{path}" if path.split("/", 1)[0] in LINKED_DIRS else None


def linked_original(path):
    """The file under csrc/ or op_builder/ that ``path`` is the sdist's copy of, or None if it is no copy."""
    prefix = f"{LINKED_COPIES_DIR}/"
    original = path[len(prefix):] if path.startswith(prefix) else None
    return original if original and linked_copy(original) == path else None


def check_linked_copies(tree, patch):
    """Refuse a patch that changes a file under csrc/ or op_builder/ and leaves the sdist's copy behind."""
    for target in dict.fromkeys(hunk.target for hunk in hunks(patch.path)):
        copy = linked_copy(target)
        if copy is None:
            continue
        original, twin = tree / target, tree / copy
        same = (original.read_bytes() == twin.read_bytes()) if original.exists() and twin.exists() else (
            original.exists() == twin.exists())
        if not same:
            raise ForkError(f"patch {patch.name} changes {target} but not the sdist's copy of it, {copy}, which "
                            "is what the wheel installs. Export the series again from the patch queue "
                            "(python -m forktools pq import, then pq export writes both; see docs/maintainers.md).")
