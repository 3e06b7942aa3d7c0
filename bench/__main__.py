"""``python -m bench``: run the benchmarks, print a table, write docs/performance.md.

Every benchmark starts its own redis-server (127.0.0.1, a free port, never
6379) and its own worker processes, and kills them when it ends.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

import mesh
from mesh.testing import find_redis_server

from . import _charts
from ._context import PEERS_VENV, Context
from ._report import Section, markdown, text_table, update_markdown
from ._util import REPO, machine, redis_server_version
from .suites import (
    balance_fleet,
    cancel,
    delayed,
    failover,
    fleet,
    fleet_trials,
    groups,
    latency,
    loops,
    memory,
    observe,
    parts,
    payloads,
    scale,
    script_cost,
    throughput,
    topology,
)

BENCHMARKS: dict[str, Callable[[Context], Awaitable[Section]]] = {
    "throughput": throughput.run,
    "failover": failover.run,
    "cancel": cancel.run,
    "latency": latency.run,
    "scale": scale.run,
    "fleet": fleet.run,
    "memory": memory.run,
    "observe": observe.run,
    "delayed": delayed.run,
    "loops": loops.run,
}
EXTRA: dict[str, Callable[[Context], Awaitable[Section]]] = {
    "parts": parts.suite,
    "balance_fleet": balance_fleet.suite,
    "topology": topology.suite,
    "payloads": payloads.suite,
    "fleet_trials": fleet_trials.suite,
    "groups": groups.suite,
    "script_cost": script_cost.suite,
}
"""Suites a full run leaves out (``--only NAME`` runs them): one aspect each,
long or heavy, whose sections docs/performance.md quotes."""
SUITES = {**BENCHMARKS, **EXTRA}
DEFAULT_OUTPUT = REPO / "docs" / "performance.md"
FINDINGS = REPO / "bench" / "findings.md"


def setup_peers() -> int:
    """Create the peers' virtualenv and install bench/peers.txt into it."""
    print(f"creating {PEERS_VENV} and installing bench/peers.txt into it", file=sys.stderr)
    PEERS_VENV.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True)
    pip = [str(PEERS_VENV / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "-r", str(REPO / "bench" / "peers.txt")], check=True)
    return 0


def revision() -> str:
    """Which trio-mesh was measured: its version, and the git commit of the
    checkout it was imported from (with a note if mesh/ or protocol/ had
    uncommitted changes), or ``$BENCH_REVISION``."""
    src = Path(mesh.__file__).resolve().parent.parent
    rev = os.environ.get("BENCH_REVISION", "")
    if not rev:
        try:
            head = subprocess.run(
                ["git", "-C", str(src), "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            dirty = subprocess.run(
                ["git", "-C", str(src), "status", "--porcelain", "--", "mesh", "protocol"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            rev = f"commit {head}" + (
                " with uncommitted changes in mesh/ or protocol/" if dirty else ""
            )
        except (OSError, subprocess.CalledProcessError):
            rev = f"from {src} (not a git checkout)"
    return f"{mesh.__version__}, {rev}"


async def main(args: argparse.Namespace) -> list[Section]:
    ctx = Context(
        runs=args.runs,
        quick=args.quick,
        peers_python=args.peers_python,
        peers=not args.no_peers,
        base=str(args.base.resolve()) if args.base else "",
        groups_jobs=args.groups_jobs,
    )
    sections = []
    names = args.only or list(BENCHMARKS)
    for name in names:
        t = time.monotonic()
        load0 = _loadavg()
        section = await SUITES[name](ctx)
        section.notes.append(
            f"Load average (1, 5, 15 min) before: {load0}; after: {_loadavg()}; "
            f"took {time.monotonic() - t:.0f} s."
        )
        ctx.log(f"{name}: {time.monotonic() - t:.0f} s")
        print(text_table(section), flush=True)
        print(flush=True)
        sections.append(section)
    return sections


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=list(SUITES),
        help=f"run only these benchmarks (a full run leaves out {', '.join(EXTRA)})",
    )
    parser.add_argument("--runs", type=int, default=3, help="runs per figure (default 3)")
    parser.add_argument(
        "--output",
        type=Path,
        help=f"write the report here (default {DEFAULT_OUTPUT.relative_to(REPO)} for a full "
        "run; --quick and --only runs write nothing unless given --output)",
    )
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument(
        "--update",
        action="store_true",
        help="with --only: replace those benchmarks' sections (their targets and charts) in "
        f"the existing report ({DEFAULT_OUTPUT.relative_to(REPO)} unless --output) and keep "
        "the others as they were measured; the report says which run measured what",
    )
    parser.add_argument(
        "--peers-python",
        help=f"interpreter with SAQ, arq and streaQ (default: {PEERS_VENV}/bin/python if it "
        "exists, else this one)",
    )
    parser.add_argument(
        "--no-peers",
        action="store_true",
        help="throughput: trio-mesh, the bare loop, BullMQ and Worqr only (SAQ, arq and streaQ "
        "take most of its time)",
    )
    parser.add_argument(
        "--base",
        type=Path,
        metavar="TREE",
        help="throughput and latency: trio-mesh at this source tree too (a checkout with mesh/ "
        "and bench/, e.g. `git worktree add ../base REV`), in the same runs, and this tree's "
        "figures over its",
    )
    parser.add_argument(
        "--groups-jobs",
        type=int,
        default=0,
        metavar="N",
        help="groups: N jobs on each side of the cost figure (N/10 groups of 10 against 1 "
        "group of N; default 1,000,000, 20,000 with --quick)",
    )
    parser.add_argument(
        "--setup-peers",
        action="store_true",
        help=f"create {PEERS_VENV} with bench/peers.txt and exit",
    )
    args = parser.parse_args(argv)
    if args.setup_peers:
        return setup_peers()
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    if args.groups_jobs and args.groups_jobs < 10:
        parser.error(f"--groups-jobs must be at least 10, not {args.groups_jobs}")
    if args.base and not (args.base / "mesh" / "__init__.py").is_file():
        parser.error(f"--base {args.base}: not a source tree of trio-mesh (no mesh/__init__.py)")
    if args.update and not args.only:
        parser.error("--update needs --only (a full run rewrites the whole report)")
    if args.update and args.quick:
        parser.error("--update and --quick: a smoke run does not belong in the report")
    output = args.output
    if output is None and (args.update or not (args.quick or args.only or args.no_write)):
        output = DEFAULT_OUTPUT
    if args.update and output is not None and not output.exists():
        parser.error(f"--update: {output} does not exist")
    if args.no_write:
        output = None
    started = datetime.datetime.now(datetime.UTC)
    sections = trio.run(main, args)
    if output is not None:
        info = machine(redis_server_version(find_redis_server()))
        info["trio-mesh"] = revision()
        at = info["trio-mesh"].split(", ", 1)[-1]  # "commit abc1234" (and a note if dirty)
        for s in sections:
            s.measured = f"{at}, {started.strftime('%Y-%m-%d %H:%M UTC')}"
        info["load average before the run"] = LOAD_BEFORE
        command = "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:])
        when = started.strftime("%Y-%m-%d %H:%M UTC")
        charts_dir = "img"
        missing = _charts.available()
        if missing:
            print(missing, file=sys.stderr)
            sections[0].notes.append(missing)
        else:
            _charts.draw(sections, output.parent / charts_dir)
        if args.update:
            note = (
                f"Updated: `{command.strip()}`, {when}, measured "
                + ", ".join(s.title for s in sections)
                + f" anew (trio-mesh {info['trio-mesh']}; load average before: "
                f"{LOAD_BEFORE}); the other sections kept what they had."
            )
            findings = FINDINGS.read_text() if FINDINGS.exists() else None
            text = update_markdown(output.read_text(), sections, note, charts_dir, findings)
        else:
            text = markdown(sections, info, command.strip(), when, charts_dir)
            if FINDINGS.exists():
                text += "\n" + FINDINGS.read_text()
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text)
        print(f"wrote {output}", file=sys.stderr)
    return 0


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


LOAD_BEFORE = _loadavg()

if __name__ == "__main__":
    sys.exit(cli())
