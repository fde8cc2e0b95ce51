"""The parts of README.md made from the series: ``python -m forktools readme [--check]``.

Each part stands between ``<!-- forktools readme: PART -->`` and ``<!-- forktools readme: end -->``:

- ``fixes``: the table of fixes, one row per patch in series order: its topic (the ``Topic:`` field,
  stable when patches are renumbered), whether the topic fixes a bug of the release or adds a feature
  (``Kind:``) and which topics must be merged upstream before it (``Depends-On:``, with their own),
  on the topic's first row, its subject, its ``Summary:`` field and its upstream status
  (``Forwarded:`` / ``Applied-Upstream:``);
- ``version``: the version a build of the series carries (``0.19.8+fork.<patches>.<digest>``).

``--check`` writes nothing and fails when README.md is not what the series makes of it.
"""

import re
from pathlib import Path

from forktools import ForkError
from forktools.files import replace_file
from forktools.prs import dependencies, topics_of
from forktools.series import local_version_label, read_series
from forktools.upstream import read_pin

README = "README.md"
_PART_RE = re.compile(r"(<!-- forktools readme: (\w+) -->)(.*?)(<!-- forktools readme: end -->)", re.S)


def upstream_status(patch):
    applied, forwarded = patch.dep3.get("Applied-Upstream", "no"), patch.dep3.get("Forwarded", "no")
    if applied != "no":
        return f"in upstream {applied}"
    if patch.fork_only:
        return "fork only"
    return "not yet forwarded" if forwarded == "no" else f"forwarded: {forwarded}"


def _cell(text):
    return text.replace("|", "\\|")


def fixes_table(repo, patches):
    rows = ["| topic | kind | merged first | patch | fixes | upstream status |", "|---|---|---|---|---|---|"]
    topics = topics_of(repo, patches)
    first_patches = {topic.patches[0].name: topic for topic in topics}
    for patch in patches:
        summary = patch.dep3.get("Summary")
        if not summary:
            raise ForkError(f"{patch.name} has no Summary: field (what it fixes, for the README's table); add it to "
                            "the patch's trailers in the patch queue (see docs/maintainers.md)")
        topic = "(fork only)" if patch.fork_only and "Topic" not in patch.dep3 else f"`{patch.topic}`"
        kind, first = "", ""
        if patch.name in first_patches:
            kind = first_patches[patch.name].kind
            first = ", ".join(f"`{dep.name}`" for dep in dependencies(first_patches[patch.name], topics)) or "none"
        rows.append(f"| {topic} | {kind} | {first} | {_cell(patch.subject)} | {_cell(summary)} | "
                    f"{upstream_status(patch)} |")
    return "\n" + "\n".join(rows) + "\n"


def render(repo):
    """README.md's text with every generated part made from the series of ``repo``."""
    repo = Path(repo)
    patches = read_series(repo)
    parts = {
        "fixes": lambda: fixes_table(repo, patches),
        "version": lambda: f"`{read_pin(repo).version}+{local_version_label(repo, patches)}`",
    }
    text = (repo / README).read_text(encoding="utf-8")
    found = {match.group(2) for match in _PART_RE.finditer(text)}
    if found != set(parts):
        raise ForkError(f"{repo / README}: expected the generated parts {', '.join(sorted(parts))} between "
                        f"'<!-- forktools readme: PART -->' and '<!-- forktools readme: end -->', found "
                        f"{', '.join(sorted(found)) or 'none'}")
    return _PART_RE.sub(lambda match: match.group(1) + parts[match.group(2)]() + match.group(4), text)


def update(repo, check=False):
    """Rewrite README.md's generated parts (or, with ``check``, only compare); returns whether they were stale."""
    path = Path(repo) / README
    text = render(repo)
    stale = text != path.read_text(encoding="utf-8")
    if stale and not check:
        replace_file(path, text.encode("utf-8"))
    return stale
