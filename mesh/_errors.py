"""The exception hierarchy: one base class, a short flat list below it.

Foreign exceptions (sockets, TLS, redis-py's parser) are mapped to these at the
boundary where they happen, with the original kept as ``__cause__``.
"""

from __future__ import annotations

import re
from typing import NoReturn

import anyio
import trio

__all__ = [
    "ClosedError",
    "CommandError",
    "ConflictError",
    "DeadLetterError",
    "ConfigError",
    "FencedError",
    "MeshConnectionError",
    "MeshError",
    "OutOfMemoryError",
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


class OutOfMemoryError(CommandError):
    """Redis refused a write because its memory is full (``used_memory`` above
    ``maxmemory``, with a policy that cannot evict, ``noeviction``). Our
    scripts that add tasks or state (enqueue, delayed and priority enqueue,
    ensure, schedule, configure, register, serve) are refused before they
    write anything, so nothing of the call was stored or acknowledged: free
    memory (finish, drain, delete) or raise ``maxmemory``, then retry.
    ``code`` is ``"OOM"``. Reads, and the paths that free memory or keep
    workers alive, keep working at the limit (see docs/operating.md)."""

    def __init__(self, message: str, code: str = "OOM") -> None:
        super().__init__(message, code)


# Redis 6.2 wraps the error reply of a command that a script ran with
# ``redis.call`` in an ``ERR`` reply that ends with it, its code after a dash:
# ``ERR Error running script (call to f_<sha>): @user_script:1: @user_script:
# 1: -OOM command not allowed ...``. Redis 7 and Valkey pass the code through.
_WRAPPED_CODE = re.compile(r": -([A-Z][A-Z0-9_]*)(?: |$)")


def error_code(exc: CommandError) -> str:
    """The code that classifies an error reply: its own first word, or, for
    an ``ERR`` that wraps the error of a command run by a script (Redis 6.2),
    that error's code. Never the server's wording, which differs between
    servers and versions (Redis, Valkey) for the same code."""
    if exc.code == "ERR":
        wrapped = _WRAPPED_CODE.search(str(exc))
        if wrapped is not None:
            return wrapped.group(1)
    return exc.code


def out_of_memory(exc: CommandError) -> OutOfMemoryError | None:
    """The :class:`OutOfMemoryError` for an error reply that is an OOM
    refusal (by its code, :func:`error_code`), else None: the reply of a
    command or of a script whose write the server refused (``OOM ...``), or
    on Redis 6.2 such a script's ``ERR`` that wraps ``-OOM``. Its message
    names maxmemory."""
    message = str(exc)
    if error_code(exc) == "OOM":
        return OutOfMemoryError(
            "Redis is out of memory (used_memory > maxmemory, policy noeviction): "
            "the write was refused before anything was stored; free memory or raise "
            f"maxmemory, then retry (Redis said: {message.strip()})"
        )
    return None


class FencedError(MeshError):
    """This worker's lease is gone or superseded: Redis no longer counts it as a
    live owner, and peers may have taken (or will take) its processes. A worker
    that sees this stops all its processes and re-registers under a new id."""


class ProtocolError(MeshError):
    """Redis holds data of an incompatible protocol version, or a reply did not
    have the shape the protocol promises."""


class ClosedError(MeshError, trio.ClosedResourceError, anyio.ClosedResourceError):
    """The client or worker was used after it was closed (by your own code: its
    ``async with`` block was left)."""


class DeadLetterError(MeshError):
    """The task whose outcome was asked for (:meth:`Client.result`) was
    dead-lettered: it failed its last allowed attempt. ``dead_letter`` is its
    record (:class:`DeadLetter`: attempts, the last error, the last worker,
    when)."""

    def __init__(self, message: str, dead_letter: object) -> None:
        super().__init__(message)
        self.dead_letter = dead_letter


class ConflictError(MeshError, ValueError):
    """The request contradicts what Redis holds, and nothing was changed: for
    example, enqueueing as a one-shot task a payload that is a persistent task
    of the same queue."""


def raise_single(eg: BaseExceptionGroup[BaseException]) -> NoReturn:
    """Re-raise the only exception of a nursery's group unwrapped, keeping its
    cause. Our context managers run background trio tasks that do not raise,
    so a group that reaches them holds what the ``async with`` body (or the
    start-up) raised: users get that exception itself, not a group."""
    exc = eg.exceptions[0]
    if len(eg.exceptions) == 1 and not isinstance(exc, BaseExceptionGroup):
        raise exc from exc.__cause__
    raise eg
