"""``mesh jobs``, ``mesh job``, ``mesh pause`` and ``mesh resume`` (run in
this process through :func:`mesh.cli.main`, against a real redis-server)."""

from __future__ import annotations

import json

import pytest
import trio

import mesh
from mesh._binding import Binding

from .cli_helpers import run_main
from .protocol_helpers import join

Q = "cliq"


@pytest.fixture
def ns_args(redis_url: str, namespace: str) -> list[str]:
    return ["--redis", redis_url, "--namespace", namespace]


def setup_jobs(redis_url: str, namespace: str) -> None:
    """On Q: one running (r1), three queued (a, b, c), one delayed (later),
    one dead (d, its error 'ValueError: <no>')."""

    async def go() -> None:
        async with mesh.open_client(redis_url, namespace=namespace) as client:
            conn, b = client._conn, Binding(client._keys)
            inc = await join(b, conn, "w1", Q)
            await client.enqueue_many(Q, ["r1", "d"])
            c = await b.claim(conn, "w1", inc, Q, 2, 1)
            dead = [p.id for p in c.processes if p.task == b"d"]
            error = 'ValueError: <no>\nTraceback (most recent call last):\n  File "h.py", line 3'
            await b.give_back(conn, "w1", Q, dead, failed=True, errors=[error])
            await client.enqueue_many(Q, ["a", "b", "c"])
            await client.enqueue(Q, "later", delay=3600)

    trio.run(go)


def test_jobs_pages_each_state_in_text_and_json(
    capsys: pytest.CaptureFixture[str], redis_url: str, namespace: str, ns_args: list[str]
) -> None:
    setup_jobs(redis_url, namespace)
    code, out, _ = run_main(capsys, "jobs", Q, "--state", "queued", "--limit", "2", *ns_args)
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"3 queued on {Q}"
    assert lines[1].split()[:3] == ["TASK", "SIZE", "KIND"]
    assert [ln.split()[0] for ln in lines[2:4]] == ["a", "b"]
    assert lines[-1] == "more: --after c2"
    code, out, _ = run_main(
        capsys, "jobs", Q, "--state", "queued", "--after", "c2", "--json", *ns_args
    )
    page = json.loads(out)
    assert code == 0 and page["next"] is None and page["total"] == 3
    assert [j["task"]["data"] for j in page["jobs"]] == ["c"]
    code, out, _ = run_main(capsys, "jobs", Q, "--state", "running", *ns_args)
    assert code == 0 and "r1" in out and "w1" in out
    code, out, _ = run_main(capsys, "jobs", Q, "--state", "dead", "--json", *ns_args)
    (d,) = json.loads(out)["jobs"]
    assert d["error"] == "ValueError: <no>" and d["state"] == "dead" and d["attempts"] == 1
    code, out, _ = run_main(capsys, "jobs", Q, "--state", "delayed", *ns_args)
    assert code == 0 and "later" in out and "DUE (UTC)" in out


def test_jobs_of_a_group_queued_and_running(
    capsys: pytest.CaptureFixture[str], redis_url: str, namespace: str, ns_args: list[str]
) -> None:
    async def go() -> None:
        async with mesh.open_client(redis_url, namespace=namespace) as client:
            conn, b = client._conn, Binding(client._keys)
            inc = await join(b, conn, "w1", Q)
            await client.enqueue_many(Q, ["g1", "g2", "g3", "g4"], group="tenant-1")
            await client.enqueue_many(Q, ["other"], group="tenant-2")
            await client.pause_group(Q, "tenant-2")
            await b.claim(conn, "w1", inc, Q, 1, 1)  # g1: tenant-2 is paused
            await client.enqueue(Q, "plain")

    trio.run(go)
    code, out, _ = run_main(
        capsys, "jobs", Q, "--group", "tenant-1", "--state", "running", *ns_args
    )
    lines = out.splitlines()
    assert code == 0 and lines[0] == f"1 running in group tenant-1 on {Q}", out
    assert lines[2].split()[0] == "g1" and "w1" in lines[2]
    code, out, _ = run_main(capsys, "jobs", Q, "--group", "tenant-1", "--limit", "2", *ns_args)
    lines = out.splitlines()
    assert code == 0 and lines[0] == f"3 queued in group tenant-1 on {Q}", out
    assert lines[1].split() == ["TASK", "SIZE", "PRIO", "ATTEMPTS"]
    assert [ln.split()[0] for ln in lines[2:4]] == ["g2", "g3"]
    assert lines[-1] == "more: --after c2"
    code, out, _ = run_main(
        capsys, "jobs", Q, "--group", "tenant-1", "--after", "c2", "--json", *ns_args
    )
    page = json.loads(out)
    assert code == 0 and page["group"] == "tenant-1" and page["state"] == "queued"
    assert page["total"] == 3 and page["next"] is None
    assert [(j["task"]["data"], j["group"]) for j in page["jobs"]] == [("g4", "tenant-1")]
    # the paused group's job is listed too; the queue's own queued list has none of them
    code, out, _ = run_main(capsys, "jobs", Q, "--group", "tenant-2", "--json", *ns_args)
    assert [j["task"]["data"] for j in json.loads(out)["jobs"]] == ["other"]
    code, out, _ = run_main(capsys, "jobs", Q, "--state", "queued", "--json", *ns_args)
    assert [j["task"]["data"] for j in json.loads(out)["jobs"]] == ["plain"]


def test_job_shows_one_record_or_exits_1(
    capsys: pytest.CaptureFixture[str], redis_url: str, namespace: str, ns_args: list[str]
) -> None:
    setup_jobs(redis_url, namespace)
    code, out, _ = run_main(capsys, "job", Q, "d", *ns_args)
    assert code == 0
    assert "state:" in out and "dead" in out and "error:" in out and "ValueError: <no>" in out
    failed = [ln for ln in out.splitlines() if ln.startswith("failed (last):")]
    assert len(failed) == 1 and "UTC on w1: ValueError: <no>" in failed[0], out
    # the error's line above, its traceback at the end, indented
    assert out.endswith('traceback of the last error:\n  Traceback (most recent call last):\n  '
                        '  File "h.py", line 3\n'), out  # fmt: skip
    code, out, _ = run_main(capsys, "job", Q, "r1", "--json", *ns_args)
    rec = json.loads(out)
    assert code == 0 and rec["state"] == "running" and rec["worker"] == "w1"
    assert isinstance(rec["token"], int)
    code, out, _ = run_main(capsys, "job", Q, "nope", *ns_args)
    assert code == 1 and "not on" in out
    code, out, _ = run_main(capsys, "job", Q, "nope", "--json", *ns_args)
    assert code == 1 and json.loads(out) is None


def test_pause_and_resume_show_in_status(
    capsys: pytest.CaptureFixture[str], redis_url: str, namespace: str, ns_args: list[str]
) -> None:
    setup_jobs(redis_url, namespace)
    assert run_main(capsys, "pause", Q, *ns_args)[:2] == (0, f"paused {Q}\n")
    assert run_main(capsys, "pause", Q, *ns_args)[:2] == (0, f"{Q} was paused already\n")
    code, out, _ = run_main(capsys, "status", "--json", *ns_args)
    (q,) = [q for q in json.loads(out)["queues"] if q["name"] == Q]
    assert code == 0 and q["paused"] is True
    code, out, _ = run_main(capsys, "status", *ns_args)
    header = next(ln for ln in out.splitlines() if ln.startswith("QUEUE "))
    row = next(ln for ln in out.splitlines() if ln.startswith(Q + " "))
    assert header.split()[-1] == "PAUSED" and row.split()[-1] == "yes"
    code, out, _ = run_main(capsys, "resume", Q, "--json", *ns_args)
    assert code == 0 and json.loads(out) == {"queue": Q, "paused": False, "changed": True}
    assert run_main(capsys, "resume", Q, *ns_args)[:2] == (0, f"{Q} was not paused\n")


@pytest.mark.parametrize(
    "argv",
    [
        ["jobs", Q, "--state", "finished"],
        ["jobs", Q],  # --state is required
        ["jobs", Q, "--state", "queued", "--limit", "0"],
        ["jobs", Q, "--state", "queued", "--limit", "x"],
        ["jobs", Q, "--state", "queued", "--after", "bogus"],
        ["jobs", "bad queue", "--state", "queued"],
        ["jobs", Q, "--group", "g", "--state", "finished"],
        ["jobs", Q, "--group", "a b"],
        ["jobs", Q, "--group", "g", "--prefix", "x"],
        ["job", "{q}", "x"],
        ["pause", "a b"],
        ["resume", ""],
    ],
)
def test_bad_arguments_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], ns_args: list[str], argv: list[str]
) -> None:
    code, out, err = run_main(capsys, *argv, *ns_args)
    assert code == 2, (out, err)
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("mesh")


def test_jobs_shows_the_first_bytes_and_the_size_of_big_payloads(
    capsys: pytest.CaptureFixture[str], redis_url: str, namespace: str, ns_args: list[str]
) -> None:
    """Three 16 MiB payloads: the page prints each one's first bytes and its
    size; JSON carries 256 bytes of each, its size and its ref."""
    from mesh._browse import PREVIEW

    payloads = [(f"blob-{i}:".encode() + "é".encode() * (8 << 20))[: 16 << 20] for i in range(3)]

    async def go() -> None:
        async with mesh.open_client(redis_url, namespace=namespace) as client:
            await client.enqueue_many(Q, payloads)

    trio.run(go)
    code, out, _ = run_main(capsys, "jobs", Q, "--state", "queued", *ns_args)
    assert code == 0, out
    *rows, hint = out.splitlines()[2:]
    assert len(rows) == 3 and all(len(r) < 200 for r in rows), rows
    assert hint.startswith("enqueue times: not kept")  # a queue that keeps none says so
    assert rows[0].startswith("blob-0:é") and "16.0 MiB" in rows[0] and "..." in rows[0]
    code, out, _ = run_main(capsys, "jobs", Q, "--state", "queued", "--json", *ns_args)
    jobs = json.loads(out)["jobs"]
    assert [j["size"] for j in jobs] == [16 << 20] * 3 and not any(j["whole"] for j in jobs)
    # the preview is cut at a whole character, never inside "é"
    head = jobs[0]["task"]
    assert head["encoding"] == "utf-8" and payloads[0].startswith(head["data"].encode())
    assert PREVIEW - 4 < len(head["data"].encode()) <= PREVIEW
    assert all(j["ref"].startswith("queued.") for j in jobs)
