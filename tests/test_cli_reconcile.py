"""``mesh reconcile`` from a stream: a preview (``--dry-run``), a guard
against cancelling most of a queue, and a list cut short by its producer
(issue 32, item 1). Real pipes between real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import trio

import mesh

from .cli_helpers import assert_one_line_error, clean_env, mesh_cli, text, utf8

DEVICES = [f"dev-{i}".encode() for i in range(10)]


@pytest.fixture
def ns_args(redis_url: str, namespace: str) -> list[str]:
    return ["--redis", redis_url, "--namespace", namespace]


async def _declared(redis_url: str, namespace: str) -> set[bytes]:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        return set(await client.persistent_tasks("devices"))


async def _piped(producer: str, ns_args: list[str], *flags: str) -> tuple[int, bytes, bytes]:
    """Run ``python -c PRODUCER | mesh reconcile devices FLAGS``: the
    producer's stdout is a real pipe into the command's stdin. Returns the
    command's exit status, stdout and stderr."""
    read_end, write_end = os.pipe()
    try:
        with trio.fail_after(60):
            prod = await trio.lowlevel.open_process(
                [sys.executable, "-c", producer], stdout=write_end, env=clean_env()
            )
            cmd = await trio.lowlevel.open_process(
                [sys.executable, "-m", "mesh.cli", "reconcile", "devices", *flags, *ns_args],
                stdin=read_end,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=clean_env(),
            )
            os.close(write_end)
            os.close(read_end)
            write_end = read_end = -1
            assert cmd.stdout is not None and cmd.stderr is not None
            out = err = b""
            async with trio.open_nursery() as nursery:

                async def drain_out() -> None:
                    nonlocal out
                    while chunk := await cmd.stdout.receive_some():  # type: ignore[union-attr]
                        out += chunk

                nursery.start_soon(drain_out)
                while chunk := await cmd.stderr.receive_some():
                    err += chunk
            code = await cmd.wait()
            await prod.wait()
    finally:
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)
    return code, out, err


_WRITE = "import os, sys; sys.stdout.buffer.write({data!r}); sys.stdout.flush(); {end}"


async def test_a_producer_that_dies_mid_line_changes_nothing(
    redis_url: str, namespace: str, ns_args: list[str]
) -> None:
    r = await mesh_cli("ensure", "devices", *[d.decode() for d in DEVICES], *ns_args)
    assert r.returncode == 0, text(r)
    # the producer writes 3 whole lines and half of the fourth, then dies
    producer = _WRITE.format(data=b"dev-0\ndev-1\ndev-2\ndev-", end="os._exit(1)")
    code, out, err = await _piped(producer, ns_args, "--yes")
    line = err.decode()
    assert code == 1 and out == b"" and line.count("\n") == 1, line
    assert "stdin ends in the middle of a line (no newline after dev-)" in line, line
    assert "nothing was changed" in line
    assert await _declared(redis_url, namespace) == set(DEVICES)


async def test_a_reconcile_that_cancels_more_than_half_needs_yes(
    redis_url: str, namespace: str, ns_args: list[str]
) -> None:
    r = await mesh_cli("ensure", "devices", *[d.decode() for d in DEVICES], *ns_args)
    assert r.returncode == 0, text(r)
    # a producer that stopped after 4 of 10 whole lines: 6 of 10 would go
    producer = _WRITE.format(data=b"dev-0\ndev-1\ndev-2\ndev-3\n", end="os._exit(0)")
    code, out, err = await _piped(producer, ns_args)
    line = err.decode()
    assert code == 2 and out == b"" and line.count("\n") == 1, line
    assert "refusing to cancel 6 of the 10 persistent tasks of devices (more than half)" in line
    assert "without --yes: nothing was changed" in line
    assert await _declared(redis_url, namespace) == set(DEVICES)

    # an empty pipe with --allow-empty: every one would go; refused too
    code, out, err = await _piped(_WRITE.format(data=b"", end=""), ns_args, "--allow-empty")
    assert code == 2 and "refusing to cancel 10 of the 10" in err.decode(), err
    assert await _declared(redis_url, namespace) == set(DEVICES)

    # half exactly is allowed; then --yes lets more than half go
    producer = _WRITE.format(data=b"".join(d + b"\n" for d in DEVICES[:5]), end="")
    code, out, err = await _piped(producer, ns_args)
    assert code == 0, err
    assert out.decode().startswith("devices: 0 added, 5 cancelled (dev-5, "), out
    assert await _declared(redis_url, namespace) == set(DEVICES[:5])
    code, out, err = await _piped(_WRITE.format(data=b"dev-0\n", end=""), ns_args, "--yes")
    assert code == 0, err
    assert await _declared(redis_url, namespace) == {b"dev-0"}


async def test_dry_run_prints_the_changes_and_changes_nothing(
    redis_url: str, namespace: str, ns_args: list[str]
) -> None:
    r = await mesh_cli("ensure", "devices", "dev-0", "dev-1", "dev-2", *ns_args)
    assert r.returncode == 0, text(r)
    producer = _WRITE.format(data=b"dev-0\nnew-1\n", end="")
    code, out, err = await _piped(producer, ns_args, "--dry-run")
    assert code == 0, err
    assert out.decode() == (
        "devices (dry run, nothing changed): would add 1 (new-1), "
        "would cancel 2 (dev-1, dev-2), 1 unchanged\n"
    )
    code, out, err = await _piped(producer, ns_args, "--dry-run", "--json")
    assert code == 0, err
    assert json.loads(out) == {
        "queue": "devices",
        "added": [utf8("new-1")],
        "cancelled": [utf8("dev-1"), utf8("dev-2")],
        "unchanged": 1,
        "dry_run": True,
    }
    # an empty list previews cancelling everything, without --allow-empty
    r = await mesh_cli("reconcile", "devices", "--dry-run", *ns_args)
    assert r.returncode == 0, text(r)
    assert "would cancel 3 (dev-0, dev-1, dev-2)" in r.stdout.decode()
    assert await _declared(redis_url, namespace) == {b"dev-0", b"dev-1", b"dev-2"}
    r = await mesh_cli("reconcile", "devices", "--file", "/no/such/file", "--dry-run", *ns_args)
    assert_one_line_error(r, 2)
