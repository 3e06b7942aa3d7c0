"""Starting a peer: a worker (or any mesh program) as an OS process.

Tests, the fault harness, the soak, bench, ``mesh demo`` and ``mesh
conformance`` all start their peers here, so a peer always gets the same
things: its standard input closed unless asked for, the environment given (by
default ours), and, with :func:`peer_env`, the ``mesh`` this process imports
first on its ``PYTHONPATH``. :func:`open_peer` gives a ``trio.Process`` (pipes
as trio streams, an async ``wait``); :func:`spawn_peer` is the same start for
callers that are not async (a ``subprocess.Popen``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, TypedDict, Unpack

import trio

__all__ = ["ROOT", "PeerOptions", "open_peer", "peer_env", "python", "spawn_peer"]

ROOT = str(Path(__file__).resolve().parents[2])
"""The directory that holds the ``mesh`` package (and, in a checkout, ``tests``
and ``bench`` beside it)."""

Stream = int | IO[Any] | None


def python(*args: str) -> list[str]:
    """The command line of this interpreter with ``args`` (``python("-m",
    "mesh.cli", "worker", ...)``)."""
    return [sys.executable, *args]


def peer_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``base`` (default: our environment) plus ``extra``, unbuffered, with
    :data:`ROOT` first on ``PYTHONPATH``: the peer imports the same ``mesh``
    as its parent, and ``tests`` or ``bench`` of a checkout."""
    env = dict(os.environ if base is None else base, PYTHONUNBUFFERED="1", **extra)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != ROOT]
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *rest])
    return env


class PeerOptions(TypedDict, total=False):
    """How to start a peer: as for ``subprocess.Popen``."""

    env: Mapping[str, str] | None
    """Its whole environment (default: ours; see :func:`peer_env`)."""
    stdin: Stream
    """Closed by default; ``PIPE`` gives a stream."""
    stdout: Stream
    stderr: Stream
    cwd: str | Path | None
    start_new_session: bool
    """A session of its own: a Ctrl-C in the terminal reaches only its parent."""


def _options(options: PeerOptions) -> dict[str, Any]:
    out: dict[str, Any] = {"stdin": subprocess.DEVNULL, **options}
    if out.get("env") is not None:
        out["env"] = dict(out["env"])
    return out


async def open_peer(argv: Sequence[str], **options: Unpack[PeerOptions]) -> trio.Process:
    """Start ``argv`` (see :func:`python`) as a peer, with ``options``
    (:class:`PeerOptions`); the caller waits for it or kills it. Pipes are
    trio streams."""
    return await trio.lowlevel.open_process(list(argv), **_options(options))


def spawn_peer(argv: Sequence[str], **options: Unpack[PeerOptions]) -> subprocess.Popen[bytes]:
    """:func:`open_peer` for a caller that is not async: the same start, as a
    ``subprocess.Popen``."""
    return subprocess.Popen(list(argv), **_options(options))
