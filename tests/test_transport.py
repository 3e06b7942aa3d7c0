"""mesh._transport: packing, the reply reader, the handshake against a real
redis-server; and mesh._reconnect's loop (on trio's mock clock: no socket)."""

from __future__ import annotations

import contextlib
import math

import anyio
import pytest
import trio
import trio.testing

from mesh._errors import CommandError, ConfigError, MeshConnectionError
from mesh._reconnect import reconnect
from mesh._transport import (
    Packed,
    backoff_delays,
    connect,
    describe,
    make_reader,
    next_reply,
    pack,
    read_replies,
    scrub,
)
from mesh._url import parse_url
from mesh.testing import RedisServer


def joined(args: tuple[object, ...]) -> bytes:
    return b"".join(pack(args))  # type: ignore[arg-type]


# --- packing ------------------------------------------------------------------


def test_pack_writes_resp_arrays_of_bulk_strings() -> None:
    assert joined(("SET", "k", b"v")) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n"
    assert joined(("X", 12, -3, 1.5, memoryview(b"mv"), "é")) == (
        b"*6\r\n$1\r\nX\r\n$2\r\n12\r\n$2\r\n-3\r\n$3\r\n1.5\r\n$2\r\nmv\r\n$2\r\n\xc3\xa9\r\n"
    )


def test_pack_splits_a_first_argument_with_spaces_only() -> None:
    assert joined(("CLIENT SETNAME", "a b")) == joined(("CLIENT", "SETNAME", "a b"))
    assert joined((b"CONFIG GET", "x")) == joined(("CONFIG", "GET", "x"))


def test_pack_does_not_copy_a_large_payload() -> None:
    big = b"x" * 10_000
    pieces = pack(("SET", "k", big))
    assert any(p is big for p in pieces)
    assert b"".join(pieces) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$10000\r\n" + big + b"\r\n"


def test_pack_refuses_what_redis_cannot_take() -> None:
    with pytest.raises(ConfigError, match="needs at least its name"):
        pack(())
    joined(("X", 1))  # 1 is cached now; True must not be taken for it
    for bad in (True, None, object()):
        with pytest.raises(ConfigError, match="cannot send this argument to Redis"):
            pack(("X", bad))  # type: ignore[arg-type]
    with pytest.raises(UnicodeEncodeError):
        pack(("X", "\udc80"))


def test_a_packed_command_is_packed_once_and_still_a_tuple() -> None:
    p = Packed(("GET", "k"))
    resp: bytes = getattr(p, "resp")  # noqa: B009 - mypy takes a tuple subclass for a tuple
    assert p == ("GET", "k") and resp == joined(("GET", "k"))
    assert pack(p) == [resp]
    with pytest.raises(ConfigError):
        Packed(("GET", None))  # type: ignore[arg-type]


def test_an_extended_packed_command_is_the_whole_command_packed() -> None:
    head = Packed(("EVALSHA", "abc", 1, "{ns}:k", 7))
    tail = ("1764987654321000", b"bytes \r\n", 42, "\u00e9" * 3, b"x" * 5000)
    p = head.extended(tail)
    assert p == (*head, *tail)
    assert pack(p) == [joined((*head, *tail))]
    assert head.extended(()) == head and pack(head.extended(())) == pack(head)
    with pytest.raises(ConfigError):
        head.extended((None,))  # type: ignore[arg-type]


# --- replies -------------------------------------------------------------------


def test_the_reader_turns_error_replies_into_command_errors() -> None:
    r = make_reader()
    r.feed(b"+OK\r\n-ERR bad thing\r\n:5\r\n*2\r\n$1\r\na\r\n-WRONGTYPE x\r\n")
    assert r.gets() == b"OK"
    err = r.gets()
    assert isinstance(err, CommandError) and err.code == "ERR" and str(err) == "ERR bad thing"
    assert r.gets() == 5
    a, inner = r.gets()
    assert a == b"a" and isinstance(inner, CommandError) and inner.code == "WRONGTYPE"


async def test_next_reply_reads_until_a_reply_is_whole() -> None:
    left, right = trio.testing.memory_stream_pair()
    reader = make_reader()
    async with trio.open_nursery() as nursery:

        async def send() -> None:
            for part in (b"$5\r\nhel", b"lo\r\n:1", b"\r\n:2\r\n"):
                await left.send_all(part)
                await trio.testing.wait_all_tasks_blocked()

        nursery.start_soon(send)
        assert await next_reply(right, reader) == b"hello"
        assert await read_replies(right, reader, 2) == [1, 2]


async def test_next_reply_raises_when_the_peer_closes() -> None:
    left, right = trio.testing.memory_stream_pair()
    await left.send_all(b"$5\r\nhe")
    await left.aclose()
    with pytest.raises(trio.BrokenResourceError, match="closed the connection"):
        await next_reply(right, make_reader())


# --- the handshake, against a real server ------------------------------------------


async def test_connect_names_the_connection_and_runs_extra_commands(
    redis_url: str,
) -> None:
    stream, reader, replies = await connect(
        parse_url(redis_url), name="t-transport", extra=[("PING",), ("ECHO", "x"), ("NOPE",)]
    )
    try:
        assert replies[:2] == [b"PONG", b"x"]
        assert isinstance(replies[2], CommandError)  # returned, not raised
        await stream.send_all(joined(("CLIENT", "GETNAME")))
        assert await next_reply(stream, reader) == b"t-transport"
    finally:
        await stream.aclose()


async def test_connect_selects_the_db(redis_url: str) -> None:
    stream, reader, _ = await connect(parse_url(redis_url + "/3"))
    async with contextlib.aclosing(stream):
        await stream.send_all(joined(("CLIENT", "INFO")))
        info = await next_reply(stream, reader)
    assert b" db=3 " in info


async def test_a_refused_connection_is_one_connection_error() -> None:
    with pytest.raises(MeshConnectionError, match=r"^could not connect to redis://127\.0\.0\.1:1"):
        await connect(parse_url("redis://127.0.0.1:1?connect_timeout=2"))


async def test_a_failed_auth_names_the_step_but_never_the_password(
    redis_server: RedisServer,
) -> None:
    url = redis_server.url.replace("redis://", "redis://user:pw-secret-77@")
    with pytest.raises(MeshConnectionError) as exc:
        await connect(parse_url(url))
    assert str(exc.value).startswith("AUTH failed on ")
    assert "pw-secret-77" not in str(exc.value)


def test_scrub_and_describe() -> None:
    config = parse_url("redis://:hunter2@127.0.0.1:1")
    assert scrub("AUTH hunter2 refused", config) == "AUTH *** refused"
    try:
        try:
            raise OSError("connection refused")
        except OSError as inner:
            raise trio.BrokenResourceError("write failed") from inner
    except trio.BrokenResourceError as exc:
        assert describe(exc) == "write failed: connection refused"
    assert describe(trio.BrokenResourceError()) == "BrokenResourceError"


# --- reconnecting (mock clock) ----------------------------------------------------------


def test_backoff_doubles_with_jitter_up_to_a_second() -> None:
    delays = backoff_delays()
    caps = [0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.0, 1.0, 1.0]
    for cap in caps:
        d = next(delays)
        assert cap / 2 <= d <= cap, (cap, d)


async def test_reconnect_retries_connection_errors_after_the_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    errors: list[str] = []
    calls = 0

    async def attempt() -> str:
        nonlocal calls
        calls += 1
        if calls < 4:
            raise MeshConnectionError(f"down {calls}")
        return "up"

    t0 = trio.current_time()
    assert await reconnect(attempt, errors.append) == "up"
    took = trio.current_time() - t0
    assert errors == ["down 1", "down 2", "down 3"]
    # four delays: at least half of 20 + 40 + 80 + 160 ms, at most all of it
    assert 0.15 <= took <= 0.3 + 1e-9


async def test_reconnect_passes_other_errors_through(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def attempt() -> None:
        raise ValueError("not a connection error")

    with pytest.raises(ValueError, match="not a connection error"):
        await reconnect(attempt, lambda _: None)


async def test_a_hurry_event_ends_the_delay_early(
    autojump_clock: trio.testing.MockClock,
) -> None:
    reached = anyio.Event()
    reached.set()  # another connection got through
    t0 = trio.current_time()
    assert await reconnect(lambda: _value(7), lambda _: None, hurry=lambda: reached) == 7
    assert trio.current_time() == t0  # no backoff slept at all
    assert not math.isnan(t0)


async def _value(v: int) -> int:
    return v
