"""Bad input to the ``mesh`` command and the API it shares its checks with:
one line, the right exit status, nothing changed (issue 32, items 8 to 15)."""

from __future__ import annotations

import pytest

import mesh
from mesh._validate import MAX_COUNT

from .cli_helpers import assert_one_line_error, mesh_cli


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
    for kwargs in ({"ttl": 1e20}, {"ttl": 1e308}, {"stop_grace": 1e308}):
        with pytest.raises(mesh.ConfigError, match="10 years"):
            async with mesh.open_worker(redis_url, namespace=namespace, **kwargs):
                pass  # pragma: no cover


async def test_schedule_remove_of_nothing_exits_1_as_job_does(ns_args: list[str]) -> None:
    r = await mesh_cli("job", "q", "nonexist", *ns_args)
    assert r.returncode == 1
    r = await mesh_cli("schedule", "remove", "q", "nonexist", *ns_args)
    assert r.returncode == 1
    assert r.stdout.decode() == "no periodic task nonexist on q\n"
