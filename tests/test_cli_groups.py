"""``mesh groups``, ``mesh group pause|resume|configure|clear``, the
``--group`` of ``mesh enqueue`` and ``mesh cancel`` and ``mesh configure
--group-*``, against a real redis-server; bad input is one line, exit 2,
nothing written."""

from __future__ import annotations

import json

import pytest

import mesh
from mesh._group_reads import GroupSettings

from .cli_helpers import assert_one_line_error, mesh_cli, text


@pytest.fixture
def ns_args(redis_url: str, namespace: str) -> list[str]:
    return ["--redis", redis_url, "--namespace", namespace]


async def test_enqueue_list_configure_pause_cancel_a_group(
    redis_url: str, namespace: str, ns_args: list[str]
) -> None:
    r = await mesh_cli("enqueue", "q", "a", "b", "c", "--group", "t1", *ns_args)
    assert r.returncode == 0 and b"enqueued 3 tasks on q group t1" in r.stdout, text(r)
    r = await mesh_cli("enqueue", "q", "d", "--group", "t2", "--delay", "100", *ns_args)
    assert b"delayed 1 task on q group t2" in r.stdout, text(r)
    r = await mesh_cli("group", "configure", "q", "t1", "--concurrency", "2", "--rate", "5/2",
                       "--weight", "3", *ns_args)  # fmt: skip
    assert r.returncode == 0 and b"concurrency=2 rate=5/2s weight=3" in r.stdout, text(r)
    r = await mesh_cli("group", "pause", "q", "t2", *ns_args)
    assert b"q group t2: paused" in r.stdout, text(r)
    r = await mesh_cli("group", "pause", "q", "t2", *ns_args)
    assert b"(no change)" in r.stdout, text(r)
    r = await mesh_cli("configure", "q", "--group-concurrency", "4", *ns_args)
    assert b"default for every group: concurrency=4 rate=- weight=-" in r.stdout, text(r)
    r = await mesh_cli("groups", "q", *ns_args)
    lines = r.stdout.decode().splitlines()
    assert lines[0].split() == [
        "GROUP", "QUEUED", "RUNNING/CAP", "DELAYED", "WEIGHT", "RATE", "PAUSED", "READY"
    ]  # fmt: skip
    assert lines[1].split() == ["t1", "3", "0/2", "0", "3", "5/2s", "-", "ready"]
    assert lines[2].split() == ["t2", "0", "0/4", "1", "1", "-", "yes", "-"]
    assert lines[3] == "2 groups: 3 queued, 0 running, 1 delayed"
    assert lines[4] == "default for every group: concurrency=4 rate=- weight=-"
    r = await mesh_cli("groups", "q", "--limit", "1", "--json", *ns_args)
    look = json.loads(r.stdout)
    assert [g["name"] for g in look["groups"]] == ["t1"]
    assert (look["total"], look["queued"], look["delayed"]) == (2, 3, 1)
    assert look["groups"][0]["own"]["weight"] == 3
    r = await mesh_cli("status", "--json", *ns_args)
    (q,) = [x for x in json.loads(r.stdout)["queues"] if x["name"] == "q"]
    assert (q["queued"], q["delayed"]) == (3, 1)  # the groups' jobs are counted
    r = await mesh_cli("cancel", "q", "a", "--group", "t1", *ns_args)
    assert b"cancelled a on q" in r.stdout, text(r)
    r = await mesh_cli("group", "clear", "q", "t1", *ns_args)
    assert r.returncode == 0, text(r)
    r = await mesh_cli("group", "resume", "q", "t2", "--json", *ns_args)
    assert json.loads(r.stdout) == {"queue": "q", "group": "t2", "paused": False, "changed": True}
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        look2 = await client.groups("q")
        (t1,) = [g for g in look2.groups if g.name == "t1"]
        assert t1.queued == 2 and t1.own == GroupSettings()
        assert all(g.paused is None for g in look2.groups)


async def test_a_groups_jobs_with_a_priority_are_listed_first(
    redis_url: str, namespace: str, ns_args: list[str]
) -> None:
    r = await mesh_cli("enqueue", "q", "a", "b", "--group", "t", *ns_args)
    assert r.returncode == 0, text(r)
    r = await mesh_cli("enqueue", "q", "urgent", "--group", "t", "--priority", "8", *ns_args)
    assert r.returncode == 0, text(r)
    r = await mesh_cli("jobs", "q", "--group", "t", "--json", *ns_args)
    assert r.returncode == 0, text(r)
    got = [(j["task"]["data"], j["priority"]) for j in json.loads(r.stdout)["jobs"]]
    assert got == [("urgent", 8), ("a", 0), ("b", 0)]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["enqueue", "q", "x", "--group", "bad name"], "argument --group: invalid group name"),
        (["enqueue", "q", "x", "--group", "g", "--priority", "10"], "priority"),
        (["cancel", "q", "x", "--group", ""], "argument --group: invalid group name"),
        (["group", "pause", "q", "a b"], "argument GROUP: invalid group name"),
        (["group", "configure", "q", "g", "--weight", "0"], "weight must be a whole number"),
        (["group", "configure", "q", "g", "--weight", "1001"], "weight must be a whole number"),
        (["group", "configure", "q", "g", "--concurrency", "-1"], "concurrency must be"),
        (["group", "configure", "q", "g", "--rate", "5/0"], "period must be"),
        (["group", "configure", "q", "g", "--rate", "x"], "not N or N/S"),
        (
            ["configure", "q", "--group-weight", "0"],
            "argument --group-weight: group_weight must be",
        ),
        (["groups", "q", "--limit", "0"], "limit must be"),
        (["group", "frobnicate", "q", "g"], "invalid choice"),
        (["exporter", "--top-groups", "1001"], "top_groups must be"),
    ],
)
async def test_bad_group_input_is_one_line_exit_2_and_writes_nothing(
    redis_url: str, namespace: str, ns_args: list[str], args: list[str], expected: str
) -> None:
    r = await mesh_cli(*args, *ns_args)
    line = assert_one_line_error(r, 2)
    assert expected in line, line
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        assert await client.queues() == []
        assert (await client.groups("q")).total == 0
