"""What every subcommand shares: the connection options, errors and exit
codes, reading tasks, and printing payloads, tables and durations."""

from __future__ import annotations

import argparse
import base64
import datetime
import importlib.util
import json
import math
import os
import sys
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import IO, Any, TypeVar

import attrs
import trio

import mesh
from mesh import _loop
from mesh._client import DEFAULT_MAX_PAYLOAD
from mesh._keys import Keys, check_queue
from mesh._units import MAX_SECONDS, seconds_ms
from mesh._validate import whole
from mesh._view import show_payload

T = TypeVar("T")

__all__ = [
    "DEFAULT_URL",
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "CliError",
    "Target",
    "run_on",
    "UsageError",
    "add_target_options",
    "check_size",
    "count_arg",
    "dump_json",
    "format_ms",
    "format_seconds",
    "format_utc",
    "json_task",
    "positive_float",
    "queue_arg",
    "read_tasks",
    "run_client",
    "seconds_arg",
    "show_task",
    "split_tasks",
    "table",
    "target",
    "task_bytes",
    "tasks_from_args",
]

DEFAULT_URL = "redis://127.0.0.1:6379"

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class CliError(Exception):
    """An expected failure of a command: printed as one line, exit status 1."""

    exit_code = EXIT_FAILURE


class UsageError(CliError):
    """The command line (or what it names) is wrong: exit status 2."""

    exit_code = EXIT_USAGE


@attrs.frozen
class Target:
    """Which mesh a command talks to."""

    config: mesh.RedisConfig
    namespace: str

    @property
    def shown(self) -> str:
        """The Redis URL without its password."""
        return self.config.redacted()


def add_target_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--redis`` and ``--namespace`` to a subcommand's parser."""
    group = parser.add_argument_group("mesh")
    group.add_argument(
        "--redis",
        metavar="URL",
        help=f"Redis URL (default: $MESH_REDIS_URL, else {DEFAULT_URL}); the password may "
        "also come from $MESH_REDIS_PASSWORD",
    )
    group.add_argument(
        "--namespace",
        metavar="NS",
        help="the mesh's namespace (default: $MESH_NAMESPACE, else 'mesh')",
    )


def target(args: argparse.Namespace) -> Target:
    """The URL and namespace from the options, else the environment, else the defaults.

    Raises:
        UsageError: a malformed URL or namespace (the message has no password).
    """
    url = _given(args.redis, "--redis", "MESH_REDIS_URL") or DEFAULT_URL
    namespace = _given(args.namespace, "--namespace", "MESH_NAMESPACE") or "mesh"
    if "://" not in url:
        source = "--redis" if args.redis is not None else "$MESH_REDIS_URL"
        if "@" in url:  # it may hold a password: not shown
            raise UsageError(
                f"the URL of {source} has no scheme: begin it with redis:// (or rediss://, "
                "unix://, redis+sentinel://, redis+cluster://); it is not shown, as it may "
                "hold a password"
            )
        raise UsageError(
            f"the URL of {source}, {url!r}, has no scheme: write redis://{url} (or "
            "rediss://, unix://, redis+sentinel://, redis+cluster://)"
        )
    try:
        config = mesh.parse_url(url)
        Keys(namespace)
    except mesh.ConfigError as exc:
        raise UsageError(str(exc)) from None
    return Target(config, namespace)


def _given(option: str | None, flag: str, variable: str) -> str | None:
    """The option's value, else the environment variable's, else None. An
    empty value is refused, not taken as "use the default": with
    ``--namespace "$NS"`` and NS unset, the default namespace is the last
    one to act on.

    Raises:
        UsageError: the option or the variable is given but empty.
    """
    if option is not None:
        if not option.strip():
            raise UsageError(f"{flag} is empty; leave it out to use the default")
        return option
    value = os.environ.get(variable)
    if value is not None and not value.strip():
        raise UsageError(f"${variable} is set but empty; unset it to use the default")
    return value


def check_size(task: bytes, what: str, limit: int = DEFAULT_MAX_PAYLOAD) -> bytes:
    """``task``, unless it is longer than ``limit`` bytes (``what`` names it
    in the error).

    Raises:
        CliError: over the limit (exit status 1: the data is bad, not the
            command line).
    """
    if len(task) > limit:
        raise CliError(
            f"{what} is {len(task)} bytes, over the limit of a task payload "
            f"({limit} bytes): nothing was sent"
        )
    return task


def task_bytes(arg: str) -> bytes:
    """A task given on the command line, as the bytes the shell passed."""
    return os.fsencode(arg)


def read_tasks(stream: IO[bytes], source: str = "stdin") -> list[bytes]:
    """Tasks from a byte stream, one per line. Line ends (``\\n`` or ``\\r\\n``)
    are not part of a task; empty lines are skipped.

    Raises:
        CliError: a line over the payload limit (``source`` names the stream).
    """
    return split_tasks(stream.read(), source)


def split_tasks(data: bytes, source: str = "stdin") -> list[bytes]:
    """Tasks from the bytes of a stream, as :func:`read_tasks` reads them.

    Raises:
        CliError: a line over the payload limit (``source`` names the stream).
    """
    out = []
    for n, line in enumerate(data.split(b"\n"), 1):
        line = line.removesuffix(b"\r")
        if line:
            check_size(line, f"line {n} of {source}")
            out.append(line)
    return out


def tasks_from_args(words: Sequence[str], stdin: IO[bytes] | None = None) -> list[bytes]:
    """The TASK words of a command, where ``-`` stands for the lines of stdin.

    Raises:
        UsageError: ``-`` given more than once, or an empty TASK (an empty
            line of stdin is no task either: the two ways agree).
        CliError: a task over the payload limit (nothing is sent then).
    """
    if words.count("-") > 1:
        raise UsageError("'-' (read tasks from stdin) may be given once")
    out: list[bytes] = []
    for i, w in enumerate(words, 1):
        if w == "-":
            out += read_tasks(stdin if stdin is not None else sys.stdin.buffer)
        elif not w:
            raise UsageError(
                f"task argument {i} is empty: a task needs a payload (as on stdin, "
                "where empty lines are skipped); nothing was sent"
            )
        else:
            out.append(check_size(task_bytes(w), f"task argument {i}"))
    return out


def show_task(task: bytes, width: int = 60) -> str:
    """A payload for humans, cut to ``width`` characters with ``...`` (see
    :func:`mesh._view.show_payload`)."""
    return show_payload(task, width, "...")


def json_task(task: bytes) -> dict[str, str]:
    """A payload in JSON output, unambiguous: ``{"encoding": "utf-8", "data":
    TEXT}`` when the bytes are valid UTF-8, else ``{"encoding": "base64",
    "data": BASE64}``. So the bytes ``caf\\xe9`` and the text ``caf\\xe9``
    never print alike."""
    try:
        return {"encoding": "utf-8", "data": task.decode()}
    except UnicodeDecodeError:
        return {"encoding": "base64", "data": base64.b64encode(task).decode()}


def dump_json(obj: Any, out: IO[str] | None = None) -> None:
    """Print ``obj`` as one line of JSON."""
    print(json.dumps(obj, separators=(",", ":")), file=out or sys.stdout, flush=True)


def table(headers: Sequence[str], rows: Iterable[Sequence[object]], right: str = "") -> list[str]:
    """Rows as aligned text lines, headers first. Columns whose header is in
    ``right`` (names separated by spaces) are right-aligned; the last column is
    not padded."""
    body = [[str(c) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in body:
        widths = [max(w, len(c)) for w, c in zip(widths, r, strict=True)]
    right_cols = set(right.split())
    lines = []
    for r in [list(headers), *body]:
        cells = [
            c.rjust(w) if h in right_cols else c.ljust(w)
            for h, c, w in zip(headers, r, widths, strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def format_seconds(seconds: float) -> str:
    """A duration, short: ``850ms``, ``4.2s``, ``3m05s``, ``2h07m``."""
    if not math.isfinite(seconds):
        return "-"
    neg = seconds < 0
    s = abs(seconds)
    if s < 1:
        text = f"{s * 1000:.0f}ms"
    elif s < 60:
        text = f"{s:.1f}s"
    elif s < 3600:
        text = f"{int(s // 60)}m{int(s % 60):02d}s"
    else:
        text = f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"
    return "-" + text if neg else text


def format_utc(t: float, ms: bool = False) -> str:
    """A time (Unix seconds) as ``YYYY-MM-DD HH:MM:SS`` in UTC (``.mmm``
    with ``ms``). What is stored in Redis is shown, never a crash: a time a
    date cannot hold (before the year 1, after 9999, not finite; written by
    an older version or by hand) is shown as ``@`` and its Unix time."""
    try:
        d = datetime.datetime.fromtimestamp(t, datetime.UTC)
    except (OverflowError, ValueError, OSError):
        return f"@{t:.0f}" if math.isfinite(t) else f"@{t}"
    if ms:
        return d.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    return d.strftime("%Y-%m-%d %H:%M:%S")


def format_ms(seconds: float) -> str:
    """A duration in whole milliseconds, e.g. ``1712 ms``."""
    return f"{seconds * 1000:.0f} ms"


def run_client(t: Target, fn: Callable[[mesh.Client], Awaitable[int]]) -> int:
    """Run ``await fn(client)`` under ``trio.run`` with a client of ``t``.

    Returns:
        What ``fn`` returned: the exit status.
    """

    async def go() -> int:
        async with mesh.open_client(t.config, namespace=t.namespace) as client:
            return await fn(client)

    return trio.run(go)


def run_on(loop: str, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Run ``await fn(*args)`` on ``loop``: "trio", "asyncio", or "uvloop"
    (:func:`mesh._loop.run`).

    Raises:
        UsageError: "uvloop" and uvloop is not installed (nothing ran).
    """
    if loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
        raise UsageError("--loop uvloop needs uvloop installed: pip install uvloop")
    return _loop.run(loop, fn, *args)


def queue_arg(name: str) -> str:
    """An argparse type for queue names."""
    try:
        return check_queue(name)
    except mesh.ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_float(text: str) -> float:
    """An argparse type: a number of seconds > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text!r}")
    return v


def seconds_arg(
    name: str, minimum: float = 0.0, maximum: float = MAX_SECONDS
) -> Callable[[str], float]:
    """An argparse type: a number of seconds that the library takes as
    ``name`` (the one rule of :func:`mesh._units.seconds_ms`: finite, from
    ``minimum`` to ``maximum``), so a bad value is a usage error (exit 2)
    and never reaches a client call."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
        try:
            seconds_ms(name, v, minimum=minimum, maximum=maximum)
        except mesh.ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return v

    return parse


def count_arg(name: str, low: int = 0, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number that the library takes as ``name``
    (the one rule of :func:`mesh._validate.whole`: from ``low`` to ``high``,
    by default at most :data:`mesh._validate.MAX_COUNT`), so that the worker's
    options and ``mesh configure`` take the same values and refuse the
    others alike: a usage error (exit 2) naming the rule."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        try:
            return whole(name, n, low, high)
        except mesh.ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse
