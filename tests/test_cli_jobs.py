"""The job-queue subcommands and options of ``mesh`` as real subprocesses:
``enqueue --delay/--at``, ``dead-letters``, ``configure``."""

from __future__ import annotations

import json

import pytest

import mesh

from .test_cli import assert_one_line_error, mesh_cli, text


@pytest.fixture
def ns_args(redis_url: str, namespace: str) -> list[str]:
    return ["--redis", redis_url, "--namespace", namespace]


async def test_enqueue_delay_and_at(redis_url: str, namespace: str, ns_args: list[str]) -> None:
    r = await mesh_cli("enqueue", "q", "a", "b", "--delay", "3600", *ns_args)
    assert r.returncode == 0, text(r)
    assert r.stdout.decode() == "delayed 2 tasks on q\n"
    r = await mesh_cli("enqueue", "q", "c", "--at", "2100-01-01T00:00:00+00:00", "--json", *ns_args)
    assert r.returncode == 0, text(r)
    assert json.loads(r.stdout) == {"queue": "q", "delayed": 1}
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        now = await client.time()
        got = await client.delayed("q")
        assert [d.task for d in got] == [b"a", b"b", b"c"]
        assert now + 3590 < got[0].due < now + 3601
        assert got[2].due == 4102444800.0
        assert await client.queue_length("q") == 0
    for bad in (["--delay", "-1"], ["--at", "2100-01-01T00:00:00"], ["--delay", "1", "--at", "5"]):
        r = await mesh_cli("enqueue", "q", "x", *bad, *ns_args)
        assert_one_line_error(r, 2)
