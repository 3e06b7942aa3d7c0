"""What the ``mesh`` command and the client do with values out of range,
with times stored out of range, and with a reader that goes away: one line
and the right exit status, never a traceback (issue 27, defects 1 to 3, 8, 9)."""

from __future__ import annotations

import datetime
import subprocess
import sys
from pathlib import Path

import pytest
import trio

import mesh
from mesh._connection import Connection
from mesh._keys import Keys
from mesh._units import MAX_SECONDS, MAX_UNIX_TIME
from mesh.cli._common import format_utc

from .cli_helpers import assert_one_line_error, clean_env, mesh_cli, text


@pytest.fixture
def ns_args(redis_url: str, namespace: str) -> list[str]:
    return ["--redis", redis_url, "--namespace", namespace]


@pytest.mark.parametrize(
    "args",
    [
        ["configure", "q", "--backoff", "1e308"],
        ["configure", "q", "--backoff-max", "1e308"],
        ["configure", "q", "--timeout", "1e308"],
        ["configure", "q", "--result-ttl", "1e308"],
        ["configure", "q", "--result-ttl", "1e12"],
        ["configure", "q", "--rate-limit", "5/1e308"],
        ["enqueue", "q", "a", "--delay", "1e20"],
        ["enqueue", "q", "a", "--delay", "1e12"],
        ["enqueue", "q", "a", "--at", "1e20"],
        ["schedule", "add", "q", "a", "--every", "0"],
        ["schedule", "add", "q", "a", "--every", "-1"],
        ["schedule", "add", "q", "a", "--every", "1e308"],
        ["schedule", "add", "q", "a", "--cron", "not a cron"],
        ["worker", "tasks:queues", "--backoff", "1e308"],
    ],
)
async def test_values_out_of_range_are_usage_errors(
    redis_url: str, namespace: str, ns_args: list[str], args: list[str]
) -> None:
    r = await mesh_cli(*args, *ns_args)
    line = assert_one_line_error(r, 2)
    assert f"argument {args[-2]}" in line, line
    if args[-2] == "--every":
        # the rule the message states is the rule applied
        assert "from 0.05 to 315,360,000 (10 years)" in line, line
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        assert await client.queues() == []
        assert await client.policy("q") is None
        assert await client.schedules() == []


async def test_the_longest_values_are_accepted(
    redis_url: str, namespace: str, ns_args: list[str]
) -> None:
    top = str(MAX_SECONDS)
    r = await mesh_cli("configure", "q", "--backoff-max", top, "--result-ttl", top, *ns_args)
    assert r.returncode == 0, text(r)
    r = await mesh_cli("enqueue", "q", "a", "--delay", top, *ns_args)
    assert r.returncode == 0, text(r)
    r = await mesh_cli("enqueue", "q", "b", "--at", "9999-12-31T23:59:59+00:00", *ns_args)
    assert r.returncode == 0, text(r)
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        policy = await client.policy("q")
        assert policy is not None and policy.backoff_max == policy.result_ttl == MAX_SECONDS
        assert [d.due for d in await client.delayed("q")][1] == MAX_UNIX_TIME


async def test_the_client_refuses_the_same_values(redis_url: str, namespace: str) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        for kwargs in (
            {"delay": 1e20},
            {"delay": 1e12},
            {"delay": MAX_SECONDS + 1},
            {"at": 1e20},
            {"at": MAX_UNIX_TIME + 1},
            {"at": datetime.datetime(9999, 12, 31, 23, 59, 59, 999999, datetime.UTC)},
        ):
            with pytest.raises(mesh.ConfigError, match=r"(delay|at) must be .* from 0 to"):
                await client.enqueue("q", "a", **kwargs)
        for name in ("backoff", "backoff_max", "timeout", "result_ttl"):
            with pytest.raises(mesh.ConfigError, match=f"{name} must be a number of seconds"):
                await client.configure("q", **{name: 1e308})  # type: ignore[arg-type]
        with pytest.raises(mesh.ConfigError, match="every must be a number of seconds"):
            await client.schedule("q", "a", every=1e308)
        assert await client.queues() == []
        assert await client.policy("q") is None
    async with mesh.open_worker(redis_url, namespace=namespace) as worker:

        async def handler(p: mesh.Process) -> None:
            pass

        with pytest.raises(mesh.ConfigError, match="backoff must be a number of seconds"):
            await worker.start_work("q", handler, backoff=1e308)


async def test_status_shows_times_stored_out_of_range(
    redis_url: str, namespace: str, ns_args: list[str], conn: Connection
) -> None:
    # Written by an older version that let any delay through: about the
    # year 97000.
    k = Keys(namespace)
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        await client.enqueue("q", "near", delay=60)
        await client.enqueue("q", "far", delay=60)
        await conn.execute("ZADD", k.delayed("q"), 3_000_000_000_000_000, b"far")
    r = await mesh_cli("status", "--delayed", *ns_args)
    assert r.returncode == 0, text(r)
    out = r.stdout.decode()
    assert "near" in out and "far" in out
    assert "@3000000000000 " in out, out
    r = await mesh_cli("status", "--delayed", "--json", *ns_args)
    assert r.returncode == 0, text(r)


def test_format_utc_never_raises() -> None:
    assert format_utc(0) == "1970-01-01 00:00:00"
    assert format_utc(1.5, ms=True) == "1970-01-01 00:00:01.500"
    assert format_utc(MAX_UNIX_TIME) == "9999-12-31 23:59:59"
    assert format_utc(1e20) == "@100000000000000000000"
    assert format_utc(-1e20).startswith("@-")
    assert format_utc(float("inf")) == "@inf"
    assert format_utc(float("nan")) == "@nan"


@pytest.mark.parametrize(
    "args", [["status", "--processes"], ["status", "--json"], ["schedule", "list"]]
)
async def test_a_reader_gone_is_no_traceback(ns_args: list[str], args: list[str]) -> None:
    """``mesh status | head -1``: the reader may be gone before we write. Here it
    always is: the only read end of the pipe is closed before the command can
    have written (it still has to start Python and ask Redis)."""
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "mesh.cli", *args, *ns_args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=clean_env(),
    )
    assert proc.stdout is not None and proc.stderr is not None
    await proc.stdout.aclose()
    err = b""
    with trio.fail_after(60):
        while chunk := await proc.stderr.receive_some():
            err += chunk
        code = await proc.wait()
    assert err == b"", err.decode()
    assert code == 1


async def test_a_stdin_line_over_the_limit_is_bad_data_not_usage(
    redis_url: str, namespace: str, ns_args: list[str], tmp_path: Path
) -> None:
    big = b"y" * (64 * 1024 * 1024 + 1)
    path = tmp_path / "desired.txt"
    path.write_bytes(b"ok\n" + big + b"\n")
    r = await mesh_cli("reconcile", "q", "--file", str(path), *ns_args)
    line = assert_one_line_error(r, 1)
    assert f"line 2 of {path} is {len(big)} bytes" in line, line
    r = await mesh_cli("enqueue", "q", "-", *ns_args, stdin=big)
    line = assert_one_line_error(r, 1)
    assert "line 1 of stdin" in line and "nothing was sent" in line, line
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        assert await client.queues() == []


async def test_ensure_of_a_running_one_shot_task_is_refused(
    redis_url: str, namespace: str, ns_args: list[str]
) -> None:
    """``mesh enqueue Q dup`` then ``mesh ensure Q dup`` while dup runs: one
    line, exit 1, and dup does not run a second time as a persistent task."""
    r = await mesh_cli("enqueue", "q", "dup", *ns_args)
    assert r.returncode == 0, text(r)
    runs: list[mesh.Process] = []
    running = trio.Event()

    async def hold(p: mesh.Process) -> None:
        runs.append(p)
        running.set()
        await trio.sleep_forever()

    async with mesh.open_worker(redis_url, namespace=namespace) as worker:
        await worker.start_work("q", hold)
        with trio.fail_after(20):
            await running.wait()
        r = await mesh_cli("ensure", "q", "dup", *ns_args)
        line = assert_one_line_error(r, 1)
        assert "runs as a one-shot task of queue q" in line, line
        async with mesh.open_client(redis_url, namespace=namespace) as client:
            assert await client.tasks("q") == []  # persistent tasks: none
        assert [(p.task, p.persistent) for p in runs] == [(b"dup", False)]
