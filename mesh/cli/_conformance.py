"""``mesh conformance``: check a peer (by default the Python one) against the
protocol's conformance suite (protocol/conformance/)."""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys

import trio

import mesh
from mesh.conformance import _suite

from ._common import EXIT_FAILURE, UsageError

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``conformance`` to the ``mesh`` parser."""
    p = sub.add_parser(
        "conformance",
        help="check a peer against the protocol's conformance suite",
        description="Replay the script vectors (through the peer's own script loader: its "
        "'script' command) and run the scenarios of protocol/conformance/ against a peer under "
        "test (default: the Python peer, python -m mesh.conformance.peer). "
        "Writes only to namespaces of its own (conformance-<random>-*), deleted at the end. "
        "Exit 0 when everything passes, 1 with a report of what failed.",
    )
    p.add_argument(
        "--redis",
        metavar="URL",
        required=True,
        help="the Redis to run on (required: it is written to; use a server of your own)",
    )
    p.add_argument(
        "--peer",
        metavar="CMD",
        help="the command that starts one peer under test (split like a shell command line, "
        "run without a shell); it speaks the line protocol of protocol/conformance/README.md",
    )
    p.add_argument(
        "--only",
        metavar="NAMES",
        help="comma-separated scenario names to run, and/or 'vectors' (default: everything)",
    )
    p.add_argument("--quiet", "-q", action="store_true", help="print only failures and the summary")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        config = mesh.parse_url(args.redis)
    except mesh.ConfigError as exc:
        raise UsageError(str(exc)) from None
    if args.peer is not None:
        try:
            words = shlex.split(args.peer)
        except ValueError as exc:
            raise UsageError(f"--peer: {exc}") from None
        if not words or shutil.which(words[0]) is None:
            raise UsageError(f"--peer: no such program: {words[0] if words else '(empty)'}")
    only = [n.strip() for n in (args.only or "").split(",") if n.strip()]
    known = {"vectors", *_suite.scenario_names()}
    unknown = [n for n in only if n not in known]
    if unknown:
        raise UsageError(
            f"--only: unknown name(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )

    def log(line: str) -> None:
        if not args.quiet:
            print(line, flush=True)

    report = trio.run(lambda: _suite.run_suite(args.redis, config, args.peer, only=only, log=log))
    for line in report.lines():
        print(line, file=sys.stdout if report.ok else sys.stderr, flush=True)
    return 0 if report.ok else EXIT_FAILURE
