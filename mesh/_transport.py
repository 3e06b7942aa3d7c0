"""One socket to one node, beneath the topology and the connections: packing,
reply reading, the handshake and the backoff delays.

The command and pub/sub connections move bytes over one byte stream (trio's, or
anyio's on asyncio) fed to a ``hiredis.Reader``; they differ only in what they do
with the replies (FIFO matching for commands, a message stream for pub/sub). The
topology opens nodes and asks sentinels with the same calls. Everything they share
lives here, once:

* :func:`connect`: open the stream (TCP, unix socket, TLS) and run the handshake
  (``AUTH``, ``SELECT``, ``CLIENT SETNAME``) in one write, bounded by
  ``connect_timeout``.
* :func:`next_reply` / :func:`read_replies`: the raw reply loop.
* :func:`backoff_delays`: exponential backoff with jitter, for the reconnect loops.

The connection's own read loop is not :func:`next_reply`: it is the hot path and
hands replies to waiters in batches; it uses the same reader and constants.
"""

from __future__ import annotations

import collections.abc
import os
import random
import ssl
from collections.abc import Sequence
from typing import Any, Final, TypeAlias

import anyio
import hiredis
import trio
from redis._parsers import Encoder
from redis.exceptions import DataError

from ._errors import CommandError, ConfigError, MeshConnectionError
from ._loop import ByteStream, aclose_forcefully, current
from ._url import RedisConfig

__all__ = [
    "Arg",
    "Packed",
    "backoff_delays",
    "connect",
    "next_reply",
    "read_replies",
]

Arg: TypeAlias = bytes | str | int | float

# Transport failures we translate to MeshConnectionError at the boundary.
TRANSPORT_ERRORS: Final = (
    OSError,
    trio.BrokenResourceError,
    anyio.BrokenResourceError,
    ssl.SSLError,
    hiredis.ProtocolError,
)


class RedisClosedError(trio.BrokenResourceError, anyio.BrokenResourceError):
    """Redis closed the connection: the stream ended (whichever loop runs)."""


#: A stream closed by our own code (trio's streams, or anyio's on asyncio).
CLOSED_ERRORS: Final = (trio.ClosedResourceError, anyio.ClosedResourceError)
RECEIVE_SIZE: Final = 256 * 1024
_BACKOFF_START: Final = 0.02
_BACKOFF_CAP: Final = 1.0
# Not a possible reply: RESP2 has no booleans, so hiredis' "no complete reply yet"
# marker is a private object.
NOT_ENOUGH_DATA: Final = object()


def reply_error(message: str) -> CommandError:
    """hiredis' ``replyError`` callback: an error reply becomes a CommandError
    (also inside arrays, e.g. in the reply of ``EXEC``)."""
    return CommandError(message, code=message.split(" ", 1)[0])


def make_reader() -> Any:
    """A fresh ``hiredis.Reader`` producing our reply types."""
    return hiredis.Reader(replyError=reply_error, notEnoughData=NOT_ENOUGH_DATA)


# Packing: RESP2 arrays of bulk strings, written here for the common argument
# types (a busy runner's script call has about 40 arguments, and redis-py's
# general serializer took twice as long). Anything else goes through redis-py's
# Encoder, which also decides what is refused (bool, None, other objects).
ENCODER: Final = Encoder(  # type: ignore[no-untyped-call]
    encoding="utf-8", encoding_errors="strict", decode_responses=False
)


# Arguments up to this many bytes are copied into one piece with their RESP
# header (fewer, larger pieces for the writer to join); larger ones are not.
_INLINE: Final = 512

# The packed pieces of recent short str and int arguments. A worker's script
# calls repeat most of theirs on every call (the script's SHA, key names, the
# worker id, counts and flags), and a dict look-up costs a fraction of
# encoding and formatting one. Arguments seen once (process ids) pass through
# it too; it is emptied when full, so it never holds more than _PIECES_MAX
# entries of at most _PIECE_MAX bytes each.
_PIECES: Final[dict[str | int, bytes]] = {}
_PIECES_MAX: Final = 1024
_PIECE_MAX: Final = 128


class Packed(tuple[Arg, ...]):
    """A command's arguments (a tuple, usable wherever a command is) with its
    RESP form made once, when it is created: :func:`pack` returns that
    instead of packing the arguments again. For a command sent many times
    unchanged (a runner's claim).

    Raises (on creation): what :func:`pack` raises for the arguments.
    """

    resp: bytes

    def __new__(cls, args: Sequence[Arg]) -> Packed:
        resp = b"".join(pack(tuple(args)))
        self = super().__new__(cls, args)
        self.resp = resp
        return self

    def extended(self, tail: Sequence[Arg]) -> Packed:
        """This command with ``tail``'s arguments after its own: only the tail
        is packed anew (a command sent many times with a few arguments that
        change, a runner's finish and claim).

        Raises:
            ConfigError: an argument of ``tail`` cannot be sent (as :func:`pack`).
        """
        out: list[bytes | memoryview] = [b"*%d\r\n" % (len(self) + len(tail))]
        resp = self.resp
        out.append(memoryview(resp)[resp.index(b"\r\n") + 2 :])
        append = out.append
        for a in tail:
            if type(a) is str:  # not cached: a tail's arguments change (ids)
                b = a.encode()
                append(b"$%d\r\n%b\r\n" % (len(b), b))
            else:
                _pieces((a,), out)
        new = tuple.__new__(Packed, (*self, *tail))
        new.resp = b"".join(out)
        return new


def pack(args: Sequence[Arg]) -> list[bytes | memoryview]:
    """Pack one command into a list of bytes for the writer to join (a large
    ``bytes`` argument is not copied here): ``str`` as UTF-8, ``int`` and
    ``float`` as their ``repr``, ``bytes`` and ``memoryview`` as they are; a
    first argument with spaces (``"CLIENT KILL"``) is split into words; a
    :class:`Packed` command's bytes are returned as they were made. An
    argument of an unsupported type is a ConfigError (nothing is sent); a
    ``str`` that is not valid UTF-8 (lone surrogates) a UnicodeEncodeError."""
    if type(args) is Packed:
        return [args.resp]
    if not args:
        raise ConfigError("a Redis command needs at least its name")
    first = args[0]
    if type(first) is str:
        if " " in first:
            args = (*first.encode().split(), *args[1:])
    elif isinstance(first, bytes) and b" " in first:
        args = (*first.split(), *args[1:])
    out: list[bytes | memoryview] = [b"*%d\r\n" % len(args)]
    _pieces(args, out)
    return out


def _pieces(args: Sequence[Arg], out: list[bytes | memoryview]) -> None:
    """Append the RESP bulk string of each of ``args`` to ``out`` (as :func:`pack`)."""
    append = out.append
    cached = _PIECES.get
    a: Any
    b: Any
    for a in args:
        t = type(a)
        if t is str or t is int:
            # exact types only: True and 1.0 are equal to 1 as dict keys
            piece = cached(a)
            if piece is not None:
                append(piece)
                continue
            b = a.encode() if t is str else b"%d" % a
            if len(b) <= _PIECE_MAX:
                piece = b"$%d\r\n%b\r\n" % (len(b), b)
                if len(_PIECES) >= _PIECES_MAX:
                    _PIECES.clear()
                _PIECES[a] = piece
                append(piece)
                continue
        elif t is bytes:
            b = a
        elif isinstance(a, bytes):
            b = a
        elif isinstance(a, str):
            b = a.encode()
        else:
            try:
                b = ENCODER.encode(a)  # type: ignore[no-untyped-call]
            except DataError as exc:
                raise ConfigError(f"cannot send this argument to Redis: {exc}") from None
        if len(b) <= _INLINE:
            # one piece per argument: its header, itself and CRLF
            append(b"$%d\r\n%b\r\n" % (len(b), b))
        else:
            # a large one is not copied here (the writer joins the pieces)
            append(b"$%d\r\n" % len(b))
            append(b)
            append(b"\r\n")


def describe(exc: BaseException) -> str:
    """A one-line description of a transport error, including the OS error behind a
    trio wrapper and the individual attempts of ``open_tcp_stream`` (or of
    anyio's ``connect_tcp`` on asyncio, whose OS errors do not say the errno's
    name: it is added, as in "Connection refused")."""
    parts = [_said(exc) or type(exc).__name__]
    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, BaseExceptionGroup):
        subs = {_said(e) for e in cause.exceptions}
        parts.append("; ".join(sorted(subs)))
    elif cause is not None and _said(cause) and _said(cause) not in parts[0]:
        parts.append(_said(cause))
    return ": ".join(parts)


def _said(exc: BaseException) -> str:
    text = str(exc)
    if isinstance(exc, OSError) and exc.errno:
        name = os.strerror(exc.errno)
        if name.lower() not in text.lower():
            text = f"{text} ({name})"
    return text


def scrub(text: str, config: RedisConfig) -> str:
    """Belt and braces: no message we build may contain a password."""
    for secret in (config.password, config.sentinel_password):
        if secret:
            text = text.replace(secret, "***")
    return text


def _ssl_context(config: RedisConfig) -> ssl.SSLContext:
    try:
        context = ssl.create_default_context(cafile=config.tls_ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"cannot load the CA file {config.tls_ca_file!r} for {config.redacted()}: {exc}"
        ) from exc
    if not config.tls_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if config.tls_cert_file is not None:
        try:
            # password="": an encrypted key fails here, instead of OpenSSL
            # asking for its passphrase on the terminal
            context.load_cert_chain(config.tls_cert_file, config.tls_key_file, password="")
        except (OSError, ssl.SSLError) as exc:
            key = f" and key {config.tls_key_file!r}" if config.tls_key_file else ""
            raise ConfigError(
                f"cannot load the client certificate {config.tls_cert_file!r}{key} for "
                f"{config.redacted()} (PEM files; the key not encrypted): {exc}"
            ) from exc
    return context


async def next_reply(stream: ByteStream, reader: Any) -> Any:
    """Return the next reply, reading the stream as needed.

    Raises:
        RedisClosedError: Redis closed the connection (a ``BrokenResourceError``
            of trio and of anyio both).
        OSError, ssl.SSLError, hiredis.ProtocolError: from the stream or the parser.
    """
    while True:
        reply = reader.gets()
        if reply is not NOT_ENOUGH_DATA:
            return reply
        data = await stream.receive_some(RECEIVE_SIZE)
        if not data:
            raise RedisClosedError("Redis closed the connection")
        reader.feed(data)


async def read_replies(stream: ByteStream, reader: Any, count: int) -> list[Any]:
    """Read exactly ``count`` replies (as :func:`next_reply`)."""
    return [await next_reply(stream, reader) for _ in range(count)]


async def connect(
    config: RedisConfig,
    *,
    name: str | None = None,
    extra: Sequence[Sequence[Arg]] = (),
) -> tuple[ByteStream, Any, list[Any]]:
    """Open a stream to Redis and authenticate, select the db and set the client name.

    The whole of it (TCP or unix connect, TLS handshake, ``AUTH``/``SELECT``/
    ``CLIENT SETNAME`` and ``extra``, all in one write) is bounded by
    ``config.connect_timeout``.

    Args:
        config: where to connect.
        name: sent with ``CLIENT SETNAME`` if given.
        extra: more commands to send after the handshake; their replies (error
            replies included, as CommandError values) are returned.

    Returns:
        The stream, the ``hiredis.Reader`` already fed with what was read, and the
        replies of ``extra``.

    Raises:
        MeshConnectionError: connecting, the TLS handshake or authentication failed,
            or it took longer than ``connect_timeout``. The message names the redacted
            URL and the cause; it never contains the password.
        ConfigError: the CA file or the client certificate cannot be loaded.

    On cancellation the half-open stream is closed and nothing is left behind.
    """
    where = config.redacted()
    loop = current()
    handshake: list[Sequence[Arg]] = []
    if config.password is not None:
        if config.username is not None:
            handshake.append(("AUTH", config.username, config.password))
        else:
            handshake.append(("AUTH", config.password))
    if config.db:
        handshake.append(("SELECT", config.db))
    if name is not None:
        handshake.append(("CLIENT", "SETNAME", name))
    context = _ssl_context(config) if config.tls else None
    stream: ByteStream | None = None
    try:
        with anyio.fail_after(config.connect_timeout):
            stream = await loop.open_stream(config.host, config.port, config.path, context)
            reader = make_reader()
            commands = [*handshake, *extra]
            replies: list[Any] = []
            if commands:
                await stream.send_all(b"".join(b"".join(pack(c)) for c in commands))
                replies = await read_replies(stream, reader, len(commands))
    except TimeoutError:
        if stream is not None:
            await aclose_forcefully(stream)
        raise MeshConnectionError(
            f"could not connect to {where} within connect_timeout={config.connect_timeout:g}s"
        ) from None
    except TRANSPORT_ERRORS as exc:
        if stream is not None:
            await aclose_forcefully(stream)
        raise MeshConnectionError(
            scrub(f"could not connect to {where}: {describe(exc)}", config)
        ) from exc
    except BaseException:
        if stream is not None:
            await aclose_forcefully(stream)
        raise
    for command, reply in zip(handshake, replies, strict=False):
        if isinstance(reply, CommandError):
            await aclose_forcefully(stream)
            step = str(command[0]) if command[0] != "CLIENT" else "CLIENT SETNAME"
            raise MeshConnectionError(
                scrub(f"{step} failed on {where}: {reply}", config)
            ) from reply
    return stream, reader, replies[len(handshake) :]


def backoff_delays() -> collections.abc.Iterator[float]:
    """Exponential backoff with jitter: each delay is uniform in [d/2, d], d going
    from 20 ms, doubling, to a 1 s cap."""
    delay = _BACKOFF_START
    while True:
        yield delay / 2 + random.random() * delay / 2
        delay = min(delay * 2, _BACKOFF_CAP)
