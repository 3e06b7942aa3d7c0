"""Running the protocol's scripts: ``EVALSHA``, and on ``NOSCRIPT`` (a
restarted server, ``SCRIPT FLUSH``) the same call sent again as ``EVAL`` with
the source, which also caches the script, so a flush is invisible to callers;
the scripts' error codes become the library's exceptions. A
:class:`ScriptCall` is one call built but not sent (sans-IO); several go in
one write with :func:`run_pipelined`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import attrs
import outcome

from ._errors import (
    CommandError,
    ConfigError,
    ConflictError,
    FencedError,
    ProtocolError,
    out_of_memory,
)
from ._scripts import Script, load_scripts
from ._transport import Packed

__all__ = [
    "Executor",
    "PipelineExecutor",
    "ScriptCall",
    "map_error",
    "run_pipelined",
    "run_reads",
    "run_script",
]

T = TypeVar("T")

# Error codes our scripts reply with, and the exception each becomes.
_ERRORS: dict[str, type[Exception]] = {
    "FENCED": FencedError,
    "VERSION": ProtocolError,
    "DUPLICATE_WORKER": ConfigError,
    "CONFLICT": ConflictError,
}


class Executor(Protocol):
    """What the binding needs of a connection."""

    async def execute(self, *args: bytes | str | int | float) -> Any: ...


class PipelineExecutor(Executor, Protocol):
    """What :func:`run_pipelined` needs: a connection that sends several
    commands in one write, in order (:meth:`Connection.pipeline`)."""

    async def pipeline(
        self, commands: Sequence[Sequence[bytes | str | int | float]], *, raise_on_error: bool
    ) -> list[Any]: ...


def map_error(exc: CommandError) -> Exception:
    cls = _ERRORS.get(exc.code)
    if cls is None:
        return out_of_memory(exc) or exc
    msg = str(exc)
    if msg.startswith(exc.code + " "):
        msg = msg[len(exc.code) + 1 :]
    return cls(msg)


async def run_script(
    conn: Executor, script: Script, keys: Sequence[str], args: Sequence[Any]
) -> Any:
    """Run one script: EVALSHA, falling back to EVAL on NOSCRIPT.

    Raises:
        FencedError, ProtocolError, ConfigError, ConflictError: the script's
            error codes (see protocol/README.md).
        OutOfMemoryError: Redis is at maxmemory and refused the script's
            first write (nothing was written).
        CommandError: any other error reply.
        MeshConnectionError: from the connection.
    """
    try:
        try:
            return await conn.execute("EVALSHA", script.sha, len(keys), *keys, *args)
        except CommandError as exc:
            if exc.code != "NOSCRIPT":
                raise
            return await conn.execute("EVAL", script.source, len(keys), *keys, *args)
    except CommandError as exc:
        mapped = map_error(exc)
        if mapped is exc:
            raise
        raise mapped from exc


async def run_reads(conn: Executor, commands: Sequence[Sequence[Any]]) -> list[Any]:
    """The replies of several read commands run as one step (``read.lua``):
    one consistent view of several keys, as ``MULTI``/``EXEC`` gives, that
    Redis also answers at the memory limit, where it refuses every command
    queued in a ``MULTI``. Each command's first argument is its key (but for
    ``TIME``); only the reads that ``read.lua`` lists are allowed.

    Raises:
        CommandError: a command's error (e.g. ``WRONGTYPE``) or ``BAD_ARG``
            (a command that is not a read): nothing of the call is answered.
        MeshConnectionError: from the connection.
    """
    keys: list[Any] = []
    seen: set[Any] = set()
    args: list[Any] = []
    for name, *rest in commands:
        args += [len(rest), name, *rest]
        if rest and str(name).upper() != "TIME" and rest[0] not in seen:
            seen.add(rest[0])
            keys.append(rest[0])
    return list(await run_script(conn, load_scripts()["read"], keys, args))


@attrs.frozen
class ScriptCall(Generic[T]):
    """One script call, built but not sent (sans-IO): the script, its keys and
    arguments, and ``parse``, which turns the call's reply into its result."""

    script: Script
    keys: Sequence[str] = attrs.field(repr=False)
    args: Sequence[Any] = attrs.field(repr=False)
    parse: Callable[[Any], T] = attrs.field(repr=False)
    #: The ``EVALSHA`` command packed once (:class:`Packed`), for a call that
    #: is sent many times (see :meth:`Binding.claim_call`); None: built anew.
    evalsha: Packed | None = attrs.field(default=None, repr=False, eq=False)

    def command(self, *, source: bool = False) -> tuple[Any, ...]:
        """The ``EVALSHA`` command, or with ``source`` the ``EVAL`` one."""
        if source:
            return ("EVAL", self.script.source, len(self.keys), *self.keys, *self.args)
        if self.evalsha is not None:
            return self.evalsha
        return ("EVALSHA", self.script.sha, len(self.keys), *self.keys, *self.args)

    def reusable(self) -> ScriptCall[T]:
        """The same call with its ``EVALSHA`` command packed once, to be sent
        many times (its keys and arguments are copied into tuples).

        Raises:
            ConfigError: an argument cannot be sent (as :meth:`Connection.execute`).
        """
        keys, args = tuple(self.keys), tuple(self.args)
        packed = Packed(("EVALSHA", self.script.sha, len(keys), *keys, *args))
        return ScriptCall(self.script, keys, args, self.parse, packed)


async def run_pipelined(
    conn: PipelineExecutor, calls: Sequence[ScriptCall[Any]]
) -> list[outcome.Outcome[Any]]:
    """Send several script calls in one write and return each one's outcome.

    Redis runs them in the order given, one after the other, with no command
    of another client in between (they arrive in one write); each is atomic
    on its own, not the group. Calls that got ``NOSCRIPT`` are sent again,
    together and in order, as ``EVAL``: should only some of them have got it
    (the script cache was flushed between two of them), those run after the
    others.

    Returns:
        Per call, in order: ``outcome.Value`` of its parsed reply, or
        ``outcome.Error`` of what :func:`run_script` would raise for it
        (FencedError and the other script error codes, CommandError).
    Raises:
        MeshConnectionError: from the connection; then it is unknown which of
            the calls ran.

    On cancellation, as for :meth:`Connection.pipeline`: the calls are
    dropped if they were not written yet, otherwise they run in Redis and
    their replies are discarded.
    """
    replies = await conn.pipeline([call.command() for call in calls], raise_on_error=False)
    results: list[outcome.Outcome[Any]] = []
    retry: list[int] = []
    for i, (call, reply) in enumerate(zip(calls, replies, strict=True)):
        if type(reply) is CommandError and reply.code == "NOSCRIPT":
            retry.append(i)
        results.append(_outcome(call, reply))
    if retry:
        replies = await conn.pipeline(
            [calls[i].command(source=True) for i in retry], raise_on_error=False
        )
        for i, reply in zip(retry, replies, strict=True):
            results[i] = _outcome(calls[i], reply)
    return results


def _outcome(call: ScriptCall[T], reply: Any) -> outcome.Outcome[T]:
    """What :func:`run_script` would return or raise for ``call``'s reply."""
    if isinstance(reply, CommandError):
        mapped = map_error(reply)
        if mapped is not reply:
            mapped.__cause__ = reply
        return outcome.Error(mapped)
    try:
        return outcome.Value(call.parse(reply))
    except Exception as exc:  # a malformed reply: that call's error
        return outcome.Error(exc)
