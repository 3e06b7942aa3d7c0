"""The ``mesh`` command: run workers, put and cancel tasks, look at a mesh,
and ``mesh demo``.

Exit status: 0 ok, 1 failure (Redis unreachable, a refused operation, the
reader of the output gone: a closed pipe), 2 usage error (bad option, URL,
name or APP), 130 interrupted. Expected failures print
one line on stderr, never a traceback, and never a password.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Sequence

import mesh

from . import (
    _browse,
    _conformance,
    _dashboard,
    _demo,
    _groups,
    _jobs,
    _metrics,
    _status,
    _tasks,
    _worker,
)
from ._common import DEFAULT_URL, EXIT_FAILURE, EXIT_INTERRUPTED, CliError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``mesh`` argument parser, with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="mesh",
        description="trio-mesh: a peer-supervised worker mesh on Redis. Every subcommand "
        "takes --redis URL (or $MESH_REDIS_URL) and --namespace NS (or $MESH_NAMESPACE); "
        "'mesh SUBCOMMAND --help' says more.",
        epilog="Start with 'mesh demo'. Exit status: 0 ok, 1 failure, 2 usage error, "
        "130 interrupted.",
    )
    parser.add_argument("--version", action="version", version=f"trio-mesh {mesh.__version__}")
    # also before the subcommand (``mesh --namespace app jobs``), as a user
    # of other tools writes them; the subcommand's own take precedence
    parser.add_argument("--redis", metavar="URL", dest="top_redis", help=argparse.SUPPRESS)
    parser.add_argument("--namespace", metavar="NS", dest="top_namespace", help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND", required=True)
    _demo.register(sub)
    _worker.register(sub)
    _tasks.register(sub)
    _jobs.register(sub)
    _groups.register(sub)
    _browse.register(sub)
    _status.register(sub)
    _metrics.register(sub)
    _dashboard.register(sub)
    _conformance.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``mesh`` command.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status. Usage errors found by argparse exit 2 through
        :class:`SystemExit`.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    prog = f"mesh {args.command}"
    for name in ("redis", "namespace"):
        if getattr(args, name, None) is None:
            setattr(args, name, getattr(args, f"top_{name}"))
    if sys.stdout is None:
        # ``mesh status >&-``: Python has no stdout at all. A command whose
        # result goes there is refused before it does anything (an enqueue
        # would happen and then fail to say so); the servers, which print
        # nothing there, run with it pointed at devnull.
        if args.command not in _NO_STDOUT:
            print(f"{prog}: error: standard output is closed: nothing was done", file=sys.stderr)
            return EXIT_FAILURE
        sys.stdout = open(os.devnull, "w")  # for the life of the process
    try:
        status: int = args.func(args)
        # Inside the try: a reader gone (``mesh status | head -1``) may
        # show only at this flush.
        sys.stdout.flush()
        return status
    except BaseException as exc:
        leaves = list(_leaves(exc))
        if any(isinstance(e, BrokenPipeError) for e in leaves):
            return _reader_gone()
        if all(isinstance(e, KeyboardInterrupt) for e in leaves):
            print(f"{prog}: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        expected = [e for e in leaves if isinstance(e, CliError | mesh.MeshError)]
        if not expected or not all(
            isinstance(e, CliError | mesh.MeshError | KeyboardInterrupt) for e in leaves
        ):
            raise
        err = expected[0]
        print(f"{prog}: error: {_one_line(_explained(err, args), args)}", file=sys.stderr)
        return err.exit_code if isinstance(err, CliError) else 1


# Commands that print nothing on stdout (they log on stderr): they run with a
# closed stdout.
_NO_STDOUT = frozenset({"worker", "dashboard", "exporter"})


def _reader_gone() -> int:
    """The reader of our output went away (a closed pipe): exit quietly, as
    a command cut short, with no traceback. The recipe of the Python docs
    (library/signal, "Note on SIGPIPE"): point stdout at devnull, so that
    the interpreter's own flush at exit cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_FAILURE


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for e in exc.exceptions:
            yield from _leaves(e)
    else:
        yield exc


def _explained(err: Exception, args: argparse.Namespace) -> str:
    """The message of ``err``, or, for a refusal the user can act on, what to
    do: a server that wants a password the URL did not give (``NOAUTH``,
    refused at the first command of the handshake) asks for one."""
    cause = err.__cause__
    if (
        isinstance(err, mesh.MeshConnectionError)
        and isinstance(cause, mesh.CommandError)
        and cause.code == "NOAUTH"
    ):
        url = getattr(args, "redis", None) or os.environ.get("MESH_REDIS_URL") or DEFAULT_URL
        try:
            shown = mesh.parse_url(url).redacted()
        except mesh.ConfigError:
            shown = "the Redis server"
        return (
            f"{shown} needs a password: give it in the URL (redis://:PASSWORD@host:port, "
            "or redis://USER:PASSWORD@host:port) or in $MESH_REDIS_PASSWORD"
        )
    return str(err)


def _one_line(message: str, args: argparse.Namespace) -> str:
    """One line, and, belt and braces, without the password of ``--redis``."""
    message = " ".join(message.split())
    url = getattr(args, "redis", None) or os.environ.get("MESH_REDIS_URL")
    if url:
        try:
            config = mesh.parse_url(url)
            passwords = (config.password, config.sentinel_password)
        except mesh.ConfigError:
            passwords = (None, None)
        for password in passwords:
            if password:
                message = message.replace(password, "***")
    return message or "failed"
