"""The job-queue subcommands and options of ``mesh`` as real subprocesses:
``enqueue --delay/--at``, ``dead-letters``, ``configure``."""

from __future__ import annotations

import json

import pytest

import mesh

from .cli_helpers import assert_one_line_error, mesh_cli, text


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


async def test_dead_letters_list_requeue_purge(
    redis_url: str, namespace: str, ns_args: list[str]
) -> None:
    from mesh._binding import Binding

    from .protocol_helpers import join

    async with mesh.open_client(redis_url, namespace=namespace) as client:
        conn, b = client._conn, Binding(client._keys)
        inc = await join(b, conn, "w1", "q")
        await client.enqueue_many("q", ["a", "b", "c"])
        c = await b.claim(conn, "w1", inc, "q", 3, 1)
        await b.give_back(
            conn,
            "w1",
            "q",
            [p.id for p in c.processes],
            failed=True,
            errors=["ValueError: bad a", "ValueError: bad b", "OSError: c"],
        )
        r = await mesh_cli("dead-letters", "q", *ns_args)
        assert r.returncode == 0, text(r)
        lines = r.stdout.decode().splitlines()
        assert lines[0].split() == ["WHEN", "(UTC)", "ATTEMPTS", "WORKER", "TASK", "ERROR"]
        assert len(lines) == 4 and "ValueError: bad a" in lines[1] and " w1 " in lines[1]
        r = await mesh_cli("dead-letters", "q", "--json", *ns_args)
        got = json.loads(r.stdout)
        assert [d["task"]["data"] for d in got["dead_letters"]] == ["a", "b", "c"]
        assert got["dead_letters"][2]["error"] == "OSError: c"
        assert got["dead_letters"][0]["attempts"] == 1
        r = await mesh_cli("dead-letters", "q", "a", "--requeue", *ns_args)
        assert r.stdout.decode() == "requeued 1 dead letter of q\n", text(r)
        assert await client.tasks("q") == [b"a"]
        r = await mesh_cli("dead-letters", "q", "--purge", "--json", *ns_args)
        assert json.loads(r.stdout) == {"queue": "q", "purged": 2}
        r = await mesh_cli("dead-letters", "q", *ns_args)
        assert r.stdout.decode() == "no dead letters on q\n"
        assert await client.tasks("q") == [b"a"]  # the live queue was left alone
        r = await mesh_cli("dead-letters", "q", "a", *ns_args)
        assert_one_line_error(r, 2)
        r = await mesh_cli("dead-letters", "q", "--requeue", "--purge", *ns_args)
        assert_one_line_error(r, 2)


async def test_configure_shows_sets_and_clears_a_policy(
    redis_url: str, namespace: str, ns_args: list[str]
) -> None:
    r = await mesh_cli("configure", "q", *ns_args)
    assert r.stdout.decode() == "q: no policy (its workers' options apply)\n", text(r)
    r = await mesh_cli("configure", "q", "--max-attempts", "2", "--timeout", "30", *ns_args)
    assert r.returncode == 0, text(r)
    assert r.stdout.decode().startswith("q: max_attempts=2 backoff=1s backoff_max=60s timeout=30s")
    r = await mesh_cli("configure", "q", "--json", *ns_args)
    assert json.loads(r.stdout)["policy"]["timeout"] == 30.0
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        assert await client.policy("q") == mesh.QueuePolicy(
            2, 1.0, 60.0, 30.0, 0.0, source="configure"
        )
    r = await mesh_cli("configure", "q", "--rate-limit", "100/60", *ns_args)
    assert "rate_limit=100/60s" in r.stdout.decode(), text(r)
    r = await mesh_cli("configure", "q", "--rate-limit", "x/1", *ns_args)
    assert_one_line_error(r, 2)
    r = await mesh_cli("configure", "q", "--backoff", "100", *ns_args)  # above backoff_max
    assert "backoff" in assert_one_line_error(r, 1)
    r = await mesh_cli("configure", "q", "--clear", *ns_args)
    assert r.stdout.decode() == "q: policy cleared\n"
    r = await mesh_cli("configure", "q", "--timeout", "-1", *ns_args)
    assert_one_line_error(r, 2)


async def test_schedule_add_list_remove(redis_url: str, namespace: str, ns_args: list[str]) -> None:
    r = await mesh_cli("schedule", "add", "q", "report", "--every", "60", *ns_args)
    assert r.stdout.decode() == "added periodic task report on q\n", text(r)
    r = await mesh_cli("schedule", "add", "q", "report", "--every", "30", *ns_args)
    assert r.stdout.decode() == "replaced periodic task report on q\n", text(r)
    r = await mesh_cli("schedule", "add", "r", "nightly", "--cron", "0 3 * * *", *ns_args)
    assert r.returncode == 0, text(r)
    r = await mesh_cli("schedule", "list", *ns_args)
    lines = r.stdout.decode().splitlines()
    assert lines[0].split() == ["QUEUE", "TASK", "WHEN", "NEXT", "(UTC)"]
    assert "every 30s" in lines[1] and "cron 0 3 * * *" in lines[2]
    r = await mesh_cli("schedule", "list", "r", "--json", *ns_args)
    (s,) = json.loads(r.stdout)
    assert (s["task"]["data"], s["cron"], s["every"]) == ("nightly", "0 3 * * *", None)
    assert s["next_run"] % 86400 == 3 * 3600
    r = await mesh_cli("schedule", "remove", "q", "report", *ns_args)
    assert r.stdout.decode() == "removed periodic task report from q\n"
    r = await mesh_cli("schedule", "remove", "q", "report", "--json", *ns_args)
    assert json.loads(r.stdout)["removed"] is False
    assert r.returncode == 1  # nothing removed: as `mesh job` for a missing job
    r = await mesh_cli("schedule", "remove", "q", "report", *ns_args)
    assert r.returncode == 1 and r.stdout.decode() == "no periodic task report on q\n"
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        assert [x.task for x in await client.schedules()] == [b"nightly"]
    r = await mesh_cli("schedule", "add", "q", "x", "--cron", "99 * * * *", *ns_args)
    assert "cron" in assert_one_line_error(r, 2)  # a usage error, as --every 0
    r = await mesh_cli("schedule", "add", "q", "x", *ns_args)  # neither --every nor --cron
    assert_one_line_error(r, 2)


async def test_enqueue_priority(redis_url: str, namespace: str, ns_args: list[str]) -> None:
    r = await mesh_cli("enqueue", "q", "low", *ns_args)
    assert r.returncode == 0, text(r)
    r = await mesh_cli("enqueue", "q", "high", "--priority", "7", "--json", *ns_args)
    assert r.returncode == 0, text(r)
    assert json.loads(r.stdout) == {"queue": "q", "enqueued": 1}
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        assert await client.tasks("q") == [b"high", b"low"]
    for bad in ("10", "-1", "x"):
        r = await mesh_cli("enqueue", "q", "x", "--priority", bad, *ns_args)
        assert_one_line_error(r, 2)
        assert "from 0 to 9" in r.stderr.decode()


async def test_status_lists_delayed_tasks(
    redis_url: str, namespace: str, ns_args: list[str]
) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        await client.enqueue(Q2, "soon", delay=60)
        await client.enqueue(Q2, "later", delay=3600, priority=4)
        await client.enqueue(Q2, "latest", at=4102444800)  # 2100-01-01
        await client.enqueue("other", "plain")
        got = await client.delayed(Q2)
        assert [(d.task, d.priority) for d in got] == [(b"soon", 0), (b"later", 4), (b"latest", 0)]
        assert await client.delayed(Q2, limit=1) == got[:1]
    r = await mesh_cli("status", "--delayed", *ns_args)
    assert r.returncode == 0, text(r)
    out = r.stdout.decode()
    assert "DELAYED (due times on the Redis clock, UTC)" in out
    section = out.split("DELAYED (due times", 1)[1]
    rows = [ln.split() for ln in section.splitlines()[2:] if ln.strip()]
    assert [row[:2] for row in rows] == [[Q2, "soon"], [Q2, "later"], [Q2, "latest"]]
    assert rows[1][-1] == "4" and rows[2][2:4] == ["2100-01-01", "00:00:00.000"]
    r = await mesh_cli("status", "--delayed", "1", "--json", *ns_args)
    assert r.returncode == 0, text(r)
    doc = json.loads(r.stdout)
    task = {"encoding": "utf-8", "data": "soon"}
    assert doc["delayed"] == [{"queue": Q2, "task": task, "due": got[0].due, "priority": 0}]
    r = await mesh_cli("status", "--delayed", "1", *ns_args)
    assert "(2 more)" in r.stdout.decode()
    r = await mesh_cli("status", *ns_args)
    assert "DELAYED (" not in r.stdout.decode()
    r = await mesh_cli("status", "--delayed", "0", *ns_args)
    assert_one_line_error(r, 2)


Q2 = "mail"
