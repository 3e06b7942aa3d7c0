"""Which event loop runs the caller (trio or asyncio), and the few things the
hot path takes from it natively.

Everything structural in the runtime (cancel scopes, task groups, events,
sleeps) is written once against anyio, which on trio is a thin layer over
trio's own objects. What a measurement showed would cost on trio's hot path
is taken from the running loop itself, through :class:`Loop`:

* parking a trio task or an asyncio task until a reply (or work) comes, and
  waking it: ``trio.lowlevel.wait_task_rescheduled``/``reschedule`` on trio
  (exactly what the connection did before), a future on asyncio;
* the clock, read without anyio's lookup of the backend;
* the byte stream to Redis: a trio stream on trio (read and written through
  its file descriptor by :mod:`mesh._wire`), an asyncio protocol on asyncio
  (:mod:`mesh._asyncio_stream`).

The loop is found when a connection, a pool or a public context manager is
made (:func:`current`), never per call.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Final, Protocol, TypeVar, cast

import anyio
import anyio.lowlevel
import outcome
import sniffio
import trio

from ._errors import ConfigError

__all__ = [
    "LOOPS",
    "RUNNERS",
    "ByteStream",
    "Loop",
    "aclose_forcefully",
    "cancel_reason",
    "current",
    "require_loop",
    "run",
]

#: The event loops trio-mesh runs on (the names sniffio gives them).
LOOPS: Final = ("trio", "asyncio")

#: What :func:`run` runs on: the loops, and "uvloop" (asyncio on uvloop).
RUNNERS: Final = ("trio", "asyncio", "uvloop")

T = TypeVar("T")


class ByteStream(Protocol):
    """What the connection needs of a byte stream (trio's ``Stream`` has it)."""

    async def send_all(self, data: bytes | bytearray | memoryview) -> None: ...

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray: ...

    async def aclose(self) -> None: ...


#: ``abort(raise_cancel)`` of a parked caller: it was cancelled before it was woken.
Abort = Callable[[Any], Any]


class Event(Protocol):
    """What trio's and anyio's events both have."""

    def set(self) -> None: ...

    def is_set(self) -> bool: ...

    async def wait(self) -> None: ...


class CancelScope(Protocol):
    """What trio's and anyio's cancel scopes both have."""

    deadline: float

    def cancel(self, reason: str | None = None) -> None: ...

    @property
    def cancel_called(self) -> bool: ...

    @property
    def cancelled_caught(self) -> bool: ...


class Loop:
    """The hot-path primitives of one event loop (see the module docstring).

    Attributes:
        name: ``"trio"`` or ``"asyncio"``.
        handle: makes the handle of the calling trio task (its ``Task``) or
            asyncio task (a new future) that :attr:`park` waits on.
        park: ``await park(handle, abort)`` waits until :attr:`wake` hands it an
            outcome, and returns its value or raises its error. Cancelled
            first, it calls ``abort`` and raises the loop's cancellation.
        wake: ``wake(handle, outcome)`` resumes a parked caller (sync; a
            handle whose caller was cancelled meanwhile is ignored on asyncio,
            and never woken on trio, where ``abort`` made sure of that).
        checkpoint, checkpoint_if_cancelled: the loop's own (trio's, or
            anyio's on asyncio), without anyio's lookup of the backend per call.
        Event, CancelScope: trio's own classes on trio, anyio's on asyncio:
            for the runner's turns and the handler pool, made per round trip
            (anyio's on trio wrap trio's, and find the backend on every one).
    """

    __slots__ = (
        "CancelScope",
        "Event",
        "checkpoint",
        "checkpoint_if_cancelled",
        "handle",
        "name",
        "park",
        "wake",
    )

    def __init__(
        self,
        name: str,
        handle: Callable[[], Any],
        park: Callable[[Any, Abort], Awaitable[Any]],
        wake: Callable[..., None],
        checkpoint: Callable[[], Awaitable[None]],
        checkpoint_if_cancelled: Callable[[], Awaitable[None]],
        event: Callable[[], Event],
        cancel_scope: Callable[..., Any],  # a CancelScope (the classes' own types)
    ) -> None:
        self.Event = event
        self.CancelScope = cancel_scope
        self.name = name
        self.checkpoint = checkpoint
        self.checkpoint_if_cancelled = checkpoint_if_cancelled
        self.handle = handle
        self.park = park
        self.wake = wake

    def clock(self) -> Callable[[], float]:
        """The running loop's clock (seconds), as a function that is cheap
        to call: trio's clock object's method, or the asyncio loop's
        ``time``. Call in the loop."""
        if self.name == "trio":
            return trio.lowlevel.current_clock().current_time
        return asyncio.get_running_loop().time

    async def open_stream(
        self,
        host: str | None,
        port: int,
        path: str | None,
        context: ssl.SSLContext | None,
    ) -> ByteStream:
        """Connect to Redis (TCP, or a unix socket at ``path``), with TLS when
        ``context`` is given. Raises OSError (and the loop's stream errors)
        on failure, like ``trio.open_tcp_stream``."""
        if self.name == "trio":
            stream: trio.abc.Stream
            if path is not None:
                stream = await trio.open_unix_socket(path)
            else:
                assert host is not None
                stream = await trio.open_tcp_stream(host, port)
            if context is not None:
                tls = trio.SSLStream(stream, context, server_hostname=host)
                await tls.do_handshake()
                stream = tls
            return stream
        from ._asyncio_stream import open_asyncio_stream

        return await open_asyncio_stream(host, port, path, context)


def _trio_park(task: Any, abort: Abort) -> Awaitable[Any]:
    # A plain function returning trio's own awaitable: no coroutine frame of
    # ours between the caller and trio on the hot path.
    return trio.lowlevel.wait_task_rescheduled(abort)  # noqa: ASYNC105


def _asyncio_handle() -> asyncio.Future[Any]:
    return asyncio.get_running_loop().create_future()


async def _asyncio_park(future: asyncio.Future[Any], abort: Abort) -> Any:
    try:
        return await future
    except asyncio.CancelledError:
        abort(None)
        raise


def _asyncio_wake(future: asyncio.Future[Any], result: Any = None) -> None:
    if future.done():
        return  # its caller was cancelled: nobody waits any more
    if result is None:
        future.set_result(None)
    elif type(result) is outcome.Value:
        future.set_result(result.value)
    else:
        future.set_exception(result.error)


async def _asyncio_checkpoint_if_cancelled() -> None:
    """anyio's ``checkpoint_if_cancelled``, and also when a deadline of the
    caller's cancel scopes has passed but its timer has not fired yet: asyncio
    runs ready callbacks before due timers, so after the process was frozen
    (SIGSTOP, a blocking call) past a deadline (the self-fence's, a time
    limit's), the caller would otherwise send one more command before its
    cancellation reaches it; trio expires deadlines before it runs anything.
    A few checkpoints let the timer fire and the cancellation land here."""
    await anyio.lowlevel.checkpoint_if_cancelled()
    if anyio.current_effective_deadline() <= asyncio.get_running_loop().time():
        for _ in range(4):
            await anyio.lowlevel.checkpoint()


_LOOPS: Final = {
    "trio": Loop(
        "trio",
        trio.lowlevel.current_task,
        _trio_park,
        trio.lowlevel.reschedule,  # its default outcome is a new Value(None)
        trio.lowlevel.checkpoint,
        trio.lowlevel.checkpoint_if_cancelled,
        trio.Event,
        trio.CancelScope,
    ),
    "asyncio": Loop(
        "asyncio",
        _asyncio_handle,
        _asyncio_park,
        _asyncio_wake,
        anyio.lowlevel.checkpoint,
        _asyncio_checkpoint_if_cancelled,
        anyio.Event,
        anyio.CancelScope,
    ),
}


def current() -> Loop:
    """The :class:`Loop` of the event loop that runs the caller.

    Raises:
        ConfigError: no event loop, or one trio-mesh does not run on.
    """
    try:
        return _LOOPS[sniffio.current_async_library()]
    except (sniffio.AsyncLibraryNotFoundError, KeyError):
        require_loop("trio-mesh")
        raise  # unreachable: require_loop raised


def require_loop(what: str) -> Loop:
    """The :class:`Loop` of the caller, checked where the public context
    managers are entered, so that a call from no event loop (or an unknown
    one) fails with a sentence naming the loops, not deep inside.

    Raises:
        ConfigError: no event loop runs the caller, or one that is neither
            trio nor asyncio; the message names ``what``.
    """
    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        library = None
    loop = _LOOPS.get(library or "")
    if loop is not None:
        return loop
    under = f"under {library}" if library else "outside any event loop"
    raise ConfigError(
        f"{what} needs trio or asyncio and was called {under}: run it with "
        "trio.run(...) or asyncio.run(...)"
    )


async def aclose_forcefully(stream: ByteStream) -> None:
    """Close ``stream`` at once, without the graceful part (a TLS close
    notify): what ``trio.aclose_forcefully`` does, for a trio or an anyio
    stream. It is a checkpoint that is never cancelled half way."""
    with anyio.CancelScope() as scope:
        scope.cancel()
        await stream.aclose()


def cancel_reason(exc: BaseException) -> str | None:
    """Why a handler was cancelled, on either loop: ``"moved"``
    (:data:`mesh.MOVED`) when its process is handed back to move to a peer
    below its fair share; another word or ``None`` otherwise.

    Args:
        exc: the cancellation the handler caught: a ``trio.Cancelled`` (its
            ``reason``, trio 0.31 and later) or an ``asyncio.CancelledError``
            (the reason the cancel scope gave it, in its message).
    """
    reason = getattr(exc, "reason", None)
    if isinstance(reason, str):
        return reason
    if isinstance(exc, asyncio.CancelledError) and exc.args and isinstance(exc.args[0], str):
        _, said, reason = exc.args[0].rpartition("; reason: ")
        if said:
            return reason
    return None


def run(loop: str, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Run ``await fn(*args)`` on ``loop`` (one of :data:`RUNNERS`), from
    outside any event loop, and return what it returned: the one place a
    command line (``mesh worker --loop``, the conformance peer, the fault
    driver, the bench children) turns a loop's name into a run.

    Raises:
        ConfigError: an unknown loop, or "uvloop" without uvloop installed;
            nothing ran.
    """
    if loop == "trio":
        return trio.run(fn, *args)
    if loop == "uvloop":
        try:
            import uvloop
        except ImportError:
            raise ConfigError(
                "the uvloop loop needs uvloop installed: pip install uvloop"
            ) from None
        return uvloop.run(cast(Coroutine[Any, Any, T], fn(*args)))
    if loop == "asyncio":
        return asyncio.run(cast(Coroutine[Any, Any, T], fn(*args)))
    raise ConfigError(f"unknown event loop {loop!r}: use one of {', '.join(RUNNERS)}")
