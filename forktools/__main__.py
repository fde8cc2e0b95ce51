"""Command line: ``python -m forktools pq import|export``, ``python -m forktools tree DIR``,
``python -m forktools style`` (upstream's style gate on what the series adds or changes),
``python -m forktools refresh --to VERSION`` (replay the series onto a new upstream release),
``python -m forktools prs`` (each topic as an upstream pull request),
``python -m forktools readme [--check]`` (README.md's version label and docs/topics.md's table, from the series),
``python -m forktools upstream-tests --upstream PATH`` (upstream's unit tests, pristine release vs fork),
``python -m forktools sizes`` (what the series adds to upstream's code)."""

import argparse
import sys
from pathlib import Path

from forktools import ForkError, pq, prs, readme, sizes, style, upstream_tests
from forktools.backend import REPO, build_patched_tree
from forktools.refresh import run as run_refresh
from forktools.upstream import BASE_TAG, make_workdir


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m forktools", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    pq_parser = commands.add_parser("pq", help="the patch queue: a git repository of the patched upstream tree")
    pq_commands = pq_parser.add_subparsers(dest="action", required=True)
    imp = pq_commands.add_parser("import", help="create the queue: pristine sdist + one commit per patch")
    imp.add_argument("--force", action="store_true", help="replace an existing queue (its changes are lost)")
    imp.add_argument("--sdist", help="local copy of the pinned sdist (default: fetched with pip)")
    exp = pq_commands.add_parser("export", help="write the queue's commits back into patches/ and patches/series")
    for sub in (imp, exp):
        sub.add_argument("--dir", type=Path, default=REPO / pq.DEFAULT_QUEUE_DIR, help="the queue's directory")
    ref = commands.add_parser("refresh", help="replay the series onto a new upstream release, then re-pin")
    target = ref.add_mutually_exclusive_group(required=True)
    target.add_argument("--to", metavar="VERSION", help="the upstream release to move to")
    target.add_argument("--continue", dest="resume", action="store_true", help="go on after a conflict is resolved")
    ref.add_argument("--sdist", help="local copy of that release's sdist (default: fetched with pip)")
    ref.add_argument("--dry-run", action="store_true", help="only report, in a temporary queue; write nothing")
    ref.add_argument("--force", action="store_true", help="replace an existing queue (its changes are lost)")
    ref.add_argument("--dir", type=Path, default=REPO / pq.DEFAULT_QUEUE_DIR, help="the queue's directory")
    tree = commands.add_parser("tree", help="print the path of a patched upstream tree (no git), for inspection")
    tree.add_argument("--sdist", help="local copy of the pinned sdist (default: fetched with pip)")
    gate = commands.add_parser("style",
                               help="check that the files the series adds or changes, tests/unit and the patches "
                               "pass upstream's style gate (yapf, flake8, codespell, license header, "
                               "deepspeed.comm/get_accelerator(), DCO)")
    gate.add_argument("--sdist", help="local copy of the pinned sdist (default: fetched with pip)")
    prs_parser = commands.add_parser("prs",
                                     help="write each topic as an upstream pull request: a git am mailbox onto the "
                                     "pristine release, with its tests, and PR.md")
    prs_parser.add_argument("--sdist", help="local copy of the pinned sdist (default: fetched with pip)")
    prs_parser.add_argument("--out", type=Path, default=REPO / prs.DEFAULT_OUT_DIR, help="output folder (replaced)")
    prs_parser.add_argument("--verify",
                            nargs="*",
                            metavar="TOPIC",
                            help="then run each fix topic's tests (or the named topics') on the pristine release "
                            "plus its dependencies, without it (they must fail) and with it (they must pass), and "
                            "write the result into its PR.md (slow: minutes per topic)")
    rdm = commands.add_parser("readme", help="rewrite README.md's version label and docs/topics.md's table of topics from the series")
    rdm.add_argument("--check", action="store_true", help="write nothing; fail if either is out of date")
    szs = commands.add_parser("sizes",
                              help="what the series adds to upstream's code: engine.py's added lines, long functions, "
                              "duplicated names, and README.md's size")
    szs.add_argument("--dir", type=Path, default=pq.DEFAULT_QUEUE_DIR, help="the patch queue (default: %(default)s)")
    ups = commands.add_parser("upstream-tests",
                              help="run upstream's own unit tests against the pinned release and the fork, "
                              "and print the test ids whose verdict differs")
    ups.add_argument("--upstream", type=Path, required=True, help="a checkout or clone of deepspeedai/DeepSpeed")
    ups.add_argument("--select",
                     action="append",
                     help="a test file or id under its tests/ folder (repeatable; default: "
                     f"{' '.join(upstream_tests.DEFAULT_SELECTION)})")
    ups.add_argument("-k", dest="keyword", help="pytest's -k expression, for both runs")
    ups.add_argument("--sdist", help="local copy of the pinned sdist (default: fetched with pip)")
    args = parser.parse_args(argv)

    try:
        if args.command == "pq" and args.action == "import":
            queue = pq.import_queue(REPO, args.dir, sdist=args.sdist, force=args.force)
            print(f"patch queue ready at {queue} (base tag '{BASE_TAG}'); edit there, then: "
                  "python -m forktools pq export")
        elif args.command == "pq" and args.action == "export":
            changed = pq.export_queue(REPO, args.dir)
            print("\n".join(f"updated patches/{name}" for name in changed) or "patches/ is up to date")
        elif args.command == "refresh":
            report = run_refresh(REPO, args.dir, args.to, args.sdist, args.force, args.dry_run, args.resume)
            print(report)
            if report.conflict:
                return 1
        elif args.command == "tree":
            path, label = build_patched_tree(make_workdir("deepspeed-fork-tree-"), {"sdist": args.sdist})
            print(path)
        elif args.command == "prs":
            exported = prs.export_topics(REPO, args.out, sdist=args.sdist)
            for topic, topic_dir in exported:
                patches = ", ".join(patch.name.split("-", 1)[0] for patch in topic.patches)
                print(f"{topic_dir}: {topic.name} ({topic.kind}; patches {patches}; {len(topic.tests)} test file(s)"
                      f"{'; depends on ' + ', '.join(topic.depends_on) if topic.depends_on else ''})")
            for problem in prs.fixes_not_standalone([topic for topic, _ in exported]):
                print(f"not yet standalone: {problem}", file=sys.stderr)
            if args.verify is not None:
                failed = prs.verify_topics(REPO, exported, sdist=args.sdist, names=args.verify)
                if failed:
                    print(f"verification failed for {', '.join(topic.name for topic in failed)}", file=sys.stderr)
                    return 1
        elif args.command == "readme":
            stale = readme.update(REPO, check=args.check)
            if stale and args.check:
                print(f"{' and '.join(stale)} out of date with the series: run python -m forktools readme",
                      file=sys.stderr)
                return 1
            names = " and ".join(readme.GENERATED)
            print(f"{' and '.join(stale)} out of date; rewritten" if stale else f"{names} up to date")
        elif args.command == "sizes":
            print("\n".join(sizes.measure(REPO / args.dir)))
            print(sizes.readme_lines((REPO / readme.README).read_text(encoding="utf-8")))
        elif args.command == "upstream-tests":
            workdir = make_workdir("deepspeed-fork-upstream-tests-")
            print(f"work directory: {workdir}", file=sys.stderr)
            summary, regressions = upstream_tests.run(args.upstream, workdir,
                                                      tuple(args.select or upstream_tests.DEFAULT_SELECTION),
                                                      args.keyword, args.sdist)
            print(summary)
            if regressions:
                print(f"{len(regressions)} test(s) pass on the pristine release and not on the fork", file=sys.stderr)
                return 1
        elif args.command == "style":
            problems, summary = style.check(REPO, sdist=args.sdist)
            for problem in problems:
                print(problem)
            if problems:
                print(f"style gate failed: {len(problems)} problem(s); see docs/maintainers.md", file=sys.stderr)
                return 1
            print(summary)
    except ForkError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
