"""The exception hierarchy: one base class, a short flat list below it.

Foreign exceptions (sockets, TLS, redis-py's parser) are mapped to these at the
boundary where they happen, with the original kept as ``__cause__``.
"""

from __future__ import annotations

import trio

__all__ = [
    "ClosedError",
    "CommandError",
    "ConflictError",
    "ConfigError",
    "FencedError",
    "MeshConnectionError",
    "MeshError",
    "ProtocolError",
]


class MeshError(Exception):
    """Base class of every error trio-mesh raises on purpose."""


class ConfigError(MeshError, ValueError):
    """A configuration or argument value is wrong: a bad URL, an invalid name, a
    TTL too small for its heartbeat interval. Raised before anything starts (or
    before anything is written), so no state changed."""


class MeshConnectionError(MeshError, ConnectionError):
    """Redis could not be reached, or the connection broke while a command was
    in flight. For a command in flight it is unknown whether Redis ran it.

    The message never contains credentials."""


class CommandError(MeshError):
    """Redis (or one of our scripts) answered a command with an error that has no
    more specific class here. ``code`` is the error's first word, e.g. ``"ERR"``,
    ``"WRONGTYPE"``, ``"OOM"``, ``"BAD_ARG"``."""

    def __init__(self, message: str, code: str = "ERR") -> None:
        super().__init__(message)
        self.code = code


class FencedError(MeshError):
    """This worker's lease is gone or superseded: Redis no longer counts it as a
    live owner, and peers may have taken (or will take) its processes. A worker
    that sees this stops all its processes and re-registers under a new id."""


class ProtocolError(MeshError):
    """Redis holds data of an incompatible protocol version, or a reply did not
    have the shape the protocol promises."""


class ClosedError(MeshError, trio.ClosedResourceError):
    """The client or worker was used after it was closed (by your own code: its
    ``async with`` block was left)."""


class ConflictError(MeshError, ValueError):
    """The request contradicts what Redis holds, and nothing was changed: for
    example, enqueueing as a one-shot task a payload that is a persistent task
    of the same queue."""
