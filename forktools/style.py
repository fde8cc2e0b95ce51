# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Upstream's style gate, run on what the fork would send upstream: ``python -m forktools style``.

Upstream DeepSpeed's pre-commit hooks and CI refuse code that yapf or clang-format would reformat,
that flake8 or codespell flag, that lacks the license header, that calls ``torch.distributed`` or ``torch.cuda``
inside ``deepspeed/``, and commits without the author's DCO sign-off. This runs the same checks on
every file the series adds or changes (in the patched upstream tree), on the fork's tests that go
upstream (``tests/unit``) and on the patch files, so that a patch can be forwarded as it stands.

Upstream's own lines are not the series' business: codespell and the torch checks look only at
the lines the series adds (the diff of the patched tree against the pristine one). yapf, flake8
and the license header judge whole files, as upstream's gate does.
"""

import ast
import difflib
import email.utils
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from forktools import ForkError
from forktools.series import PATCH_DIR, diff_hunks, hunks, linked_original, read_series
from forktools.upstream import make_workdir, pinned_release


@dataclass(frozen=True)
class Tool:
    """A checker the gate runs from the running Python environment, at the exact version upstream uses."""
    dist: str
    version: str
    run: tuple  # the arguments to the running Python that start it


# The gate's exact versions (yapf, flake8 and clang-format as upstream pins them): another version
# formats or flags differently. clang-format's wheel has no __main__ module; its entry point runs it.
TOOLS = (
    Tool("yapf", "0.40.0", ("-m", "yapf")),
    Tool("flake8", "5.0.4", ("-m", "flake8")),
    Tool("codespell", "2.4.3", ("-m", "codespell_lib")),
    Tool("clang-format", "18.1.3", ("-c", "import clang_format; clang_format.clang_format()")),
)
# Where upstream pins its formatters in the sdist: the gate refuses to run if a release pins another.
UPSTREAM_DEV_REQUIREMENTS = Path("requirements") / "requirements-dev.txt"
# Upstream's .style.yapf.
YAPF_STYLE = "{based_on_style: pep8, split_all_comma_separated_values: false, column_limit: 119}"
# Upstream's .clang-format is in its git repository, not in the sdist. These are its settings: Google's
# style with what the file changes, as `clang-format --dump-config` of it shows with clang-format 18.1.3
# (its Objective-C and protobuf raw-string settings left out: nothing here uses them). Formatted with
# either, every C/C++ file of the 0.19.8 sdist comes out the same (checked when this was written).
CLANG_FORMAT_STYLE = {
    "BasedOnStyle": "Google",
    "AccessModifierOffset": -4,
    "AllowAllParametersOfDeclarationOnNextLine": False,
    "AllowShortBlocksOnASingleLine": "Always",
    "AllowShortCaseLabelsOnASingleLine": True,
    "BinPackArguments": False,
    "BinPackParameters": False,
    "BreakBeforeBraces": "WebKit",
    "ColumnLimit": 100,
    "DerivePointerAlignment": False,
    "IncludeBlocks": "Preserve",
    "IndentWidth": 4,
    "PenaltyBreakAssignment": 4,
    "Standard": "Latest",
    "TabWidth": 4,
}
# The files upstream's clang-format hook formats (pre-commit's c, c++ and cuda types).
CLANG_FORMAT_SUFFIXES = (".c", ".h", ".cc", ".cpp", ".cxx", ".hh", ".hpp", ".hxx", ".cu", ".cuh")
# Upstream's flake8 configuration. --isolated: no configuration file around may change it.
FLAKE8_OPTIONS = ("--isolated", "--select=E9,F,W6", "--ignore=E,F403,F405,F541,F841,W",
                  "--per-file-ignores=__init__.py:F401")
LICENSE_HEADER = ("# Copyright (c) Microsoft Corporation.", "# SPDX-License-Identifier: Apache-2.0", "",
                  "# DeepSpeed Team")
# Inside deepspeed/, collectives go through deepspeed.comm and device code through the accelerator; the
# files upstream's check-torchdist hook excludes (deepspeed.comm itself, which wraps torch.distributed)
# may use torch.distributed.
TORCHDIST_EXCLUDED = re.compile(r"^(deepspeed/comm/|deepspeed/moe/sharded_moe.py|"
                                r"deepspeed/runtime/comm/coalesced_collectives.py|"
                                r"deepspeed/elasticity/elastic_agent.py|deepspeed/launcher/launch.py)")
FORBIDDEN_IN_DEEPSPEED = (
    (re.compile(r"\btorch\.distributed\b|^\s*from\s+torch\s+import\s.*\bdistributed\b"),
     "uses torch.distributed; upstream's code goes through deepspeed.comm", TORCHDIST_EXCLUDED),
    (re.compile(r"\btorch\.cuda\b|^\s*from\s+torch\s+import\s.*\bcuda\b"),
     "uses torch.cuda; upstream's code goes through get_accelerator() (deepspeed.accelerator)", None),
)
# The fork's tests that go upstream unchanged (tests/fork tests the fork's own tooling).
UPSTREAM_TESTS = Path("tests") / "unit"

_REPORT_RE = re.compile(r"^(.*?):(\d+): (.*)$")


@dataclass(frozen=True, order=True)
class Problem:
    name: str
    line: int
    message: str

    def __str__(self):
        return f"{self.name}:{self.line}: {self.message}"


@dataclass
class Checked:
    """A file the gate checks: its name in reports, where it lies, and the lines the fork wrote."""
    name: str
    path: Path
    fork_lines: set

    @property
    def is_python(self):
        return self.name.endswith(".py")

    @property
    def is_c_or_cpp(self):
        return self.name.endswith(CLANG_FORMAT_SUFFIXES)


def check_tools():
    """Refuse to run with a missing tool or another version than upstream's, naming what to install."""
    wrong = []
    for tool in TOOLS:
        try:
            installed = importlib.metadata.version(tool.dist)
        except importlib.metadata.PackageNotFoundError:
            wrong.append(f"  {tool.dist} is not installed (needed: {tool.dist}=={tool.version})")
            continue
        if installed != tool.version:
            wrong.append(f"  {tool.dist} {installed} is installed, upstream's gate uses {tool.dist}=={tool.version}")
    if wrong:
        pins = " ".join(f"{tool.dist}=={tool.version}" for tool in TOOLS)
        raise ForkError(
            f"the style gate needs upstream's tool versions in this Python environment ({sys.executable}):\n" +
            "\n".join(wrong) + f"\nInstall them with: {sys.executable} -m pip install {pins}")


def check_upstream_pins(pristine):
    """Refuse to run when the release pins another version of a tool than the gate's (after a refresh)."""
    path = Path(pristine) / UPSTREAM_DEV_REQUIREMENTS
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", path.read_text(), re.M)) if path.is_file() else {}
    for tool in TOOLS:
        if pins.get(tool.dist, tool.version) != tool.version:
            raise ForkError(f"upstream pins {tool.dist}=={pins[tool.dist]} in {UPSTREAM_DEV_REQUIREMENTS.as_posix()}, "
                            f"the style gate uses {tool.dist}=={tool.version}: update TOOLS in forktools/style.py and "
                            "requirements/test.txt")


def _read_lines(path):
    return Path(path).read_bytes().decode("utf-8", errors="replace").splitlines()


def added_lines(old_lines, new_lines):
    """Numbers (1-based, in the new file) of the lines a diff from old to new adds."""
    # No autojunk: its heuristic treats frequent lines (blank ones) as noise and can report
    # unchanged lines as replaced.
    matcher = difflib.SequenceMatcher(None, old_lines, new_lines, autojunk=False)
    return {
        number + 1
        for tag, _, _, start, end in matcher.get_opcodes() if tag in ("replace", "insert")
        for number in range(start, end)
    }


def changed_files(pristine, patched):
    """Every file of the patched tree that the series added or changed, with the lines it added.

    The sdist's copies of csrc/ and op_builder/ files are left out: upstream has links there, and the
    originals are checked.
    """
    changed = []
    for path in sorted(p for p in patched.rglob("*") if p.is_file()):
        name = path.relative_to(patched).as_posix()
        before = pristine / name
        if linked_original(name) or (before.is_file() and before.read_bytes() == path.read_bytes()):
            continue
        old_lines = _read_lines(before) if before.is_file() else []
        changed.append(Checked(name, path, added_lines(old_lines, _read_lines(path))))
    return changed


def upstream_tests(repo):
    """The fork's tests that go upstream, all of whose lines are the fork's (an sdist of the fork has none)."""
    tests = Path(repo) / UPSTREAM_TESTS
    if not tests.is_dir():
        return []
    checked = []
    for path in sorted(tests.rglob("*.py")):
        if "__pycache__" not in path.parts:
            all_lines = set(range(1, len(_read_lines(path)) + 1))
            checked.append(Checked(path.relative_to(repo).as_posix(), path, all_lines))
    return checked


def patch_files(patches):
    """The patch files, with their own lines: everything but the upstream lines quoted in the hunks."""
    checked = []
    for patch in patches:
        lines = _read_lines(patch.path)
        quoted = set()
        for hunk in hunks(patch.path):
            for offset, line in enumerate(hunk.lines[1:], start=1):
                if line[:1] in (" ", "-", ""):
                    quoted.add(hunk.line + offset)
        own = set(range(1, len(lines) + 1)) - quoted
        checked.append(Checked(f"{PATCH_DIR}/{patch.name}", patch.path, own))
    return checked


def _run_tool(dist, args, cwd, ok_codes):
    """Run a tool of the current Python environment; its report goes to stdout."""
    tool = next(tool for tool in TOOLS if tool.dist == dist)
    proc = subprocess.run([sys.executable, *tool.run, *args],
                          cwd=cwd,
                          stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE,
                          text=True)
    # Each tool reports its findings on stdout: a failure exit with nothing there is the tool's own failure.
    if proc.returncode not in ok_codes or (proc.returncode != 0 and not proc.stdout.strip()):
        raise ForkError(f"{dist} failed (exit code {proc.returncode}):\n{proc.stderr.strip()[-4000:]}")
    return proc.stdout


def _reports(output, by_path):
    """Split ``path:line: message`` lines of a tool's output into (checked file, line, message)."""
    for line in output.splitlines():
        match = _REPORT_RE.match(line)
        if match and match.group(1) in by_path:
            yield by_path[match.group(1)], int(match.group(2)), match.group(3)


def _changed_runs(diff_lines):
    """(original file, first original line, number of original lines) for each run of changes in a unified diff."""
    for hunk in diff_hunks(diff_lines):
        old_line, run_start, run_length = hunk.old_start, None, 0
        for line in hunk.lines[1:]:
            tag = line[:1]
            if tag in ("-", "+"):
                if run_start is None:
                    run_start, run_length = old_line, 0
                run_length += tag == "-"
            elif tag != "\\" and run_start is not None:
                yield hunk.source, run_start, run_length
                run_start = None
            if tag in (" ", "-", ""):
                old_line += 1
        if run_start is not None:
            yield hunk.source, run_start, run_length


def yapf_problems(files, cwd):
    # yapf stops at the first file it cannot parse; flake8 reports those (E999).
    parsable = []
    for checked in files:
        try:
            ast.parse(checked.path.read_bytes(), filename=checked.name)
        except (SyntaxError, ValueError):
            continue
        parsable.append(checked)
    if not parsable:
        return []
    by_path = {str(checked.path): checked for checked in parsable}
    # One yapf per core, each on a share of the files (largest first): yapf takes most of the gate's
    # time, and its own --parallel lets the workers' diffs interleave on stdout.
    paths = sorted(by_path, key=lambda path: -Path(path).stat().st_size)
    workers = min(os.cpu_count() or 1, len(paths))
    shares = [paths[i::workers] for i in range(workers)]
    with ThreadPoolExecutor(len(shares)) as pool:
        diffs = pool.map(lambda share: _run_tool("yapf", ["--style", YAPF_STYLE, "--diff", *share], cwd, (0, 1)),
                         shares)
        diff = "".join(diffs)
    return _reformat_problems("yapf", diff.splitlines(), by_path)


def clang_format_problems(files, cwd):
    """clang-format with upstream's style leaves each C/C++ file unchanged (as its pre-commit hook checks)."""
    style = json.dumps(CLANG_FORMAT_STYLE)
    diff = []
    by_path = {str(checked.path): checked for checked in files}
    for path, checked in by_path.items():
        formatted = _run_tool("clang-format", [f"--style={style}", path], cwd, ok_codes=(0, ))
        diff += difflib.unified_diff(_read_lines(path), formatted.splitlines(), path, path, lineterm="")
    return _reformat_problems("clang-format", diff, by_path)


def _reformat_problems(tool, diff_lines, by_path):
    """One problem per run of lines a formatter's unified diff changes."""
    problems = []
    for source, line, length in _changed_runs(diff_lines):
        checked = by_path[source]
        if length == 0:
            what = "would insert lines before this line"
        elif length == 1:
            what = "would reformat this line"
        else:
            what = f"would reformat lines {line}-{line + length - 1}"
        problems.append(Problem(checked.name, line, f"{tool} (upstream's style) {what}"))
    return problems


def flake8_problems(files, cwd):
    if not files:
        return []
    by_path = {str(checked.path): checked for checked in files}
    output = _run_tool("flake8", [*FLAKE8_OPTIONS, "--format=%(path)s:%(row)d: %(code)s %(text)s", *by_path],
                       cwd,
                       ok_codes=(0, 1))
    return [Problem(checked.name, line, f"flake8 {message}") for checked, line, message in _reports(output, by_path)]


def codespell_problems(files, cwd):
    if not files:
        # Without file arguments codespell would check the whole working directory.
        return []
    by_path = {str(checked.path): checked for checked in files}
    # codespell exits 65 when it finds a misspelling.
    output = _run_tool("codespell", list(by_path), cwd, ok_codes=(0, 65))
    return [
        Problem(checked.name, line, f"codespell: {message}") for checked, line, message in _reports(output, by_path)
        if line in checked.fork_lines
    ]


def license_problems(checked):
    lines = _read_lines(checked.path)
    start = 0
    if lines and lines[0].startswith("#!"):
        # Upstream's scripts put the header after the interpreter line and a blank line.
        start = 1
        while start < len(lines) and not lines[start].strip():
            start += 1
    for offset, expected in enumerate(LICENSE_HEADER):
        found = lines[start + offset] if start + offset < len(lines) else None
        if found != expected:
            if found is not None and start + offset + 1 not in checked.fork_lines:
                # A header the series did not write is upstream's business, as the lines a hunk quotes are
                # (upstream's own files carry variants its gate accepts).
                return []
            shown = "end of file" if found is None else repr(found)
            message = (f"license header: expected {expected!r}, found {shown} "
                       "(upstream's 4-line header starts every .py file)")
            return [Problem(checked.name, start + offset + 1, message)]
    return []


def torch_problems(checked):
    problems = []
    lines = _read_lines(checked.path)
    for number in sorted(checked.fork_lines):
        for pattern, message, excluded in FORBIDDEN_IN_DEEPSPEED:
            if excluded is not None and excluded.match(checked.name):
                continue
            if pattern.search(lines[number - 1]):
                problems.append(Problem(checked.name, number, message))
    return problems


def _same_person(first, second):
    # Names must match exactly; mail domains are case-insensitive and so, in practice, are addresses.
    return first[0] == second[0] and first[1].lower() == second[1].lower()


def signoff_problems(patch):
    """Upstream's DCO check: a ``Signed-off-by:`` trailer naming the patch's author."""
    author = email.utils.parseaddr(patch.author)
    signoffs = [
        line.partition(":")[2].strip() for line in patch.message.splitlines() if line.startswith("Signed-off-by:")
    ]
    if any(_same_person(email.utils.parseaddr(signoff), author) for signoff in signoffs):
        return []
    lines = _read_lines(patch.path)
    wanted = "Signed-off-by:" if signoffs else "From:"
    line = next((number for number, text in enumerate(lines, start=1) if text.startswith(wanted)), 1)
    author_text = email.utils.formataddr(author)
    if signoffs:
        message = f"DCO: no Signed-off-by: trailer names the author {author_text} (found: {'; '.join(signoffs)})"
    else:
        message = f"DCO: no Signed-off-by: trailer; add 'Signed-off-by: {author_text}'"
    return [Problem(f"{PATCH_DIR}/{patch.name}", line, message)]


def check(repo, sdist=None):
    """Run the gate on the series of ``repo``. Returns (sorted problems, one-line summary of what was checked)."""
    check_tools()
    repo = Path(repo)
    patches = read_series(repo)
    workdir = make_workdir("deepspeed-fork-style-")
    try:
        release = pinned_release(repo, workdir, sdist)
        pristine = release.tree(workdir / "pristine")
        check_upstream_pins(pristine)
        patched = release.tree(workdir / "patched", patches)
        changed = changed_files(pristine, patched)
        tests = upstream_tests(repo)
        python = [checked for checked in changed + tests if checked.is_python]
        # The tools run in the work directory, where no configuration file of either tree applies.
        problems = yapf_problems(python, workdir) + flake8_problems(python, workdir)
        problems += clang_format_problems([checked for checked in changed if checked.is_c_or_cpp], workdir)
        problems += codespell_problems(changed + tests + patch_files(patches), workdir)
        for checked in python:
            problems += license_problems(checked)
        for checked in changed:
            if checked.name.startswith("deepspeed/"):
                problems += torch_problems(checked)
        for patch in patches:
            problems += signoff_problems(patch)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    versions = ", ".join(f"{tool.dist} {tool.version}" for tool in TOOLS)
    summary = (f"style gate passed: {len(patches)} patches, the {len(changed)} files they add or change, "
               f"{len(tests)} files under {UPSTREAM_TESTS.as_posix()} ({versions})")
    return sorted(set(problems)), summary
