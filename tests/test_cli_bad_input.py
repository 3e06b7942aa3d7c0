"""Bad input to the ``mesh`` command and the API it shares its checks with:
one line, the right exit status, nothing changed (issue 32, items 8 to 15)."""

from __future__ import annotations

import json
import sys

import pytest

import mesh
from mesh._validate import MAX_COUNT
from mesh._view import show_payload
from mesh.testing import run_redis_server

from .cli_helpers import assert_one_line_error, clean_env, mesh_cli, text, utf8


@pytest.fixture
def ns_args(redis_url: str, namespace: str) -> list[str]:
    return ["--redis", redis_url, "--namespace", namespace]


# --- items 8 to 10: one rule per number, the same for the worker and configure


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["worker", "mesh.cli.demo_app:queues", "--ttl", "1e20"],
            "ttl must be a number of seconds from 0 to 315,360,000 (10 years), got 1e+20",
        ),
        (["worker", "mesh.cli.demo_app:queues", "--ttl", "1e308"], "got 1e+308"),
        (
            ["worker", "mesh.cli.demo_app:queues", "--stop-grace", "1e308"],
            "stop_grace must be a number of seconds from 0 to 315,360,000 (10 years)",
        ),
        (["worker", "mesh.cli.demo_app:queues", "--rejoin-grace", "1e12"], "rejoin_grace must"),
        (
            ["configure", "q", "--max-attempts", "99999999999999999999999"],
            "max_attempts must be "
            "a whole number from 0 to 1,000,000,000, got 99999999999999999999999",
        ),
        (
            ["worker", "mesh.cli.demo_app:queues", "--max-attempts", "99999999999999999999999"],
            "max_attempts must be a whole number from 0 to 1,000,000,000",
        ),
        (["configure", "q", "--max-attempts", "-1"], "max_attempts must be a whole number >= 0"),
        (
            ["worker", "mesh.cli.demo_app:queues", "--max-attempts", "-1"],
            "max_attempts must be a whole number >= 0",
        ),
        (
            ["configure", "q", "--rate-limit", "99999999999999999999999/2"],
            "rate_limit must be a whole number from 0 to 1,000,000,000",
        ),
        (["configure", "q", "--rate-limit", "10/"], "no seconds after the '/': '10/'"),
        (
            ["worker", "mesh.cli.demo_app:queues", "--concurrency", "0"],
            "concurrency must be a whole number >= 1, got 0",
        ),
    ],
)
async def test_numbers_out_of_range_are_usage_errors_with_one_rule(
    redis_url: str, namespace: str, ns_args: list[str], args: list[str], expected: str
) -> None:
    r = await mesh_cli(*args, *ns_args)
    line = assert_one_line_error(r, 2)
    assert f"argument {args[-2]}" in line and expected in line, line
    assert "Lua" not in line and "script" not in line and "inf" not in line.split("got")[-1]
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        assert await client.policy("q") is None
        assert await client.workers() == []


async def test_the_api_refuses_the_same_numbers(redis_url: str, namespace: str) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        with pytest.raises(mesh.ConfigError, match="max_attempts must be a whole number from 0"):
            await client.configure("q", max_attempts=10**20)
        with pytest.raises(mesh.ConfigError, match="rate_limit must be a whole number from 0"):
            await client.configure("q", rate_limit=(10**20, 1.0))
        assert await client.policy("q") is None
        policy = await client.configure("q", max_attempts=MAX_COUNT, rate_limit=MAX_COUNT)
        assert policy.max_attempts == MAX_COUNT and policy.rate_limit == MAX_COUNT
    for ttl, stop_grace in ((1e20, 10.0), (1e308, 10.0), (3.0, 1e308)):
        with pytest.raises(mesh.ConfigError, match="10 years"):
            async with mesh.open_worker(
                redis_url, namespace=namespace, ttl=ttl, stop_grace=stop_grace
            ):
                pass  # pragma: no cover


async def test_schedule_remove_of_nothing_exits_1_as_job_does(ns_args: list[str]) -> None:
    r = await mesh_cli("job", "q", "nonexist", *ns_args)
    assert r.returncode == 1
    r = await mesh_cli("schedule", "remove", "q", "nonexist", *ns_args)
    assert r.returncode == 1
    assert r.stdout.decode() == "no periodic task nonexist on q\n"


# --- item 11: a closed stdout


@pytest.mark.parametrize("args", [["status"], ["enqueue", "q", "a"], ["ensure", "q", "a"]])
async def test_a_closed_stdout_is_refused_before_anything_is_done(
    redis_url: str, namespace: str, ns_args: list[str], args: list[str]
) -> None:
    # ``>&-``: the command starts with no file descriptor 1 at all
    r = await mesh_cli(
        "-c",
        'exec "$0" -m mesh.cli "$@" >&-',
        sys.executable,
        *args,
        *ns_args,
        command=("/bin/sh",),
    )
    line = assert_one_line_error(r, 1)
    assert line == f"mesh {args[0]}: error: standard output is closed: nothing was done", line
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        assert await client.queues() == []


# --- item 12: an empty payload


async def test_an_empty_task_argument_is_refused_as_an_empty_line_is_skipped(
    redis_url: str, namespace: str, ns_args: list[str]
) -> None:
    for command in ("enqueue", "ensure"):
        r = await mesh_cli(command, "q", "a", "", *ns_args)
        line = assert_one_line_error(r, 2)
        assert "task argument 2 is empty" in line and "nothing was sent" in line, line
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        assert await client.queues() == []
        # one put there through the API shows as b'', never as a blank
        await client.enqueue("q", b"")
        assert show_payload(b"") == "b''"
    r = await mesh_cli("jobs", "q", "--state", "queued", *ns_args)
    assert r.returncode == 0, text(r)
    assert r.stdout.decode().splitlines()[2].startswith("b''  "), r.stdout.decode()


# --- item 13: cancel reads '-' as stdin


async def test_cancel_reads_tasks_from_stdin_for_dash(
    redis_url: str, namespace: str, ns_args: list[str]
) -> None:
    r = await mesh_cli("ensure", "devices", "-", *ns_args, stdin=b"-\nd1\nd2\n")
    assert r.returncode == 0, text(r)
    r = await mesh_cli("cancel", "devices", "-", *ns_args, stdin=b"-\nd1\n")
    assert r.returncode == 0, text(r)
    assert r.stdout.decode().splitlines() == [
        "cancelled - on devices: 1 queued copy or running process",
        "cancelled d1 on devices: 1 queued copy or running process",
    ]
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        assert set(await client.persistent_tasks("devices")) == {b"d2"}
    r = await mesh_cli("cancel", "devices", "d2", "--json", *ns_args)
    assert json.loads(r.stdout) == {"queue": "devices", "task": utf8("d2"), "cancelled": 1}


# --- item 15: messages that say what to do


async def test_options_before_the_subcommand_are_taken(
    redis_url: str, namespace: str, ns_args: list[str]
) -> None:
    r = await mesh_cli("--namespace", namespace, "--redis", redis_url, "enqueue", "q", "a")
    assert r.returncode == 0, text(r)
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        assert await client.tasks("q") == [b"a"]
    # the subcommand's own take precedence
    r = await mesh_cli("--namespace", "elsewhere", "jobs", "q", "--state", "queued", *ns_args)
    assert r.returncode == 0 and r.stdout.decode().startswith("1 queued on q"), text(r)


async def test_a_url_without_a_scheme_is_named(namespace: str) -> None:
    r = await mesh_cli("status", "--redis", "127.0.0.1:7611", "--namespace", namespace)
    line = assert_one_line_error(r, 2)
    assert line == (
        "mesh status: error: the URL of --redis, '127.0.0.1:7611', has no scheme: write "
        "redis://127.0.0.1:7611 (or rediss://, unix://, redis+sentinel://, redis+cluster://)"
    )
    r = await mesh_cli("status", env=clean_env(MESH_REDIS_URL="user:hunter2@127.0.0.1:7611"))
    line = assert_one_line_error(r, 2)
    assert "the URL of $MESH_REDIS_URL has no scheme" in line and "hunter2" not in line, line


async def test_a_server_that_wants_a_password_asks_for_one(namespace: str) -> None:
    with run_redis_server(["--requirepass", "s3cret"]) as server:
        url = f"redis://127.0.0.1:{server.port}"
        for args in (["status"], ["enqueue", "q", "a"]):
            r = await mesh_cli(*args, "--redis", url, "--namespace", namespace)
            line = assert_one_line_error(r, 1)
            assert line == (
                f"mesh {args[0]}: error: {url}/0 needs a password: give it in the URL "
                "(redis://:PASSWORD@host:port, or redis://USER:PASSWORD@host:port) or in "
                "$MESH_REDIS_PASSWORD"
            ), line
        r = await mesh_cli(
            "enqueue", "q", "a", "--redis", url, env=clean_env(MESH_REDIS_PASSWORD="s3cret")
        )
        assert r.returncode == 0, text(r)


async def test_a_refusal_names_the_payload(
    redis_url: str, namespace: str, ns_args: list[str]
) -> None:
    r = await mesh_cli("ensure", "devices", "d9", *ns_args)
    assert r.returncode == 0, text(r)
    r = await mesh_cli("enqueue", "devices", "a", "b", "d9", *ns_args)
    line = assert_one_line_error(r, 1)
    assert line.startswith("mesh enqueue: error: task d9 is a persistent task of queue devices")
    r = await mesh_cli("enqueue", "jobs", "j1", *ns_args)
    assert r.returncode == 0, text(r)
    r = await mesh_cli("ensure", "jobs", "x", "j1", *ns_args)
    line = assert_one_line_error(r, 1)
    assert line.startswith("mesh ensure: error: task j1 is a one-shot task of queue jobs"), line
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        # nothing of the refused calls was sent
        assert await client.tasks("devices") == [b"d9"] and await client.tasks("jobs") == [b"j1"]
