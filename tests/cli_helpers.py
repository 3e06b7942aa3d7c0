"""Helpers for tests that run the ``mesh`` command or another process:
start it, read its stderr up to a line, check a one-line error."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import trio

from mesh._harness.peer import open_peer
from mesh.cli import main

__all__ = [
    "assert_one_line_error",
    "clean_env",
    "mesh_cli",
    "running_process",
    "stderr_until",
    "text",
    "utf8",
]


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without any MESH_* variable (so that nothing can reach
    a Redis the test did not start), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESH_")}
    env.update(extra)
    return env


@asynccontextmanager
async def running_process(argv: Sequence[str], **kwargs: Any) -> AsyncIterator[trio.Process]:
    """A process started with :func:`mesh._harness.peer.open_peer` (``kwargs``
    as for it) for the body; killed (if the body did not end it) and reaped on
    the way out, whatever happened in the body."""
    proc = await open_peer(argv, **kwargs)
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def stderr_until(proc: trio.Process, pattern: bytes, within: float = 20) -> bytes:
    """What ``proc`` wrote to its piped stderr, up to the first match of the
    regular expression ``pattern`` (fails the test if the stream ends first,
    or after ``within`` seconds); it may hold a little more."""
    assert proc.stderr is not None
    log = b""
    with anyio.fail_after(within):
        while not re.search(pattern, log):
            chunk = await proc.stderr.receive_some()
            assert chunk, log
            log += chunk
    return log


async def mesh_cli(
    *args: str,
    stdin: bytes = b"",
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    command: Sequence[str] = (sys.executable, "-m", "mesh.cli"),
) -> subprocess.CompletedProcess[bytes]:
    """Run the ``mesh`` command to its end (within 60 s)."""
    with anyio.fail_after(60):
        return await trio.run_process(
            [*command, *args],
            stdin=stdin,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=env if env is not None else clean_env(),
            cwd=cwd,
        )


def utf8(text: str) -> dict[str, str]:
    """A payload as ``--json`` prints valid UTF-8."""
    return {"encoding": "utf-8", "data": text}


def text(r: subprocess.CompletedProcess[bytes]) -> str:
    return (r.stdout + r.stderr).decode(errors="replace")


def assert_one_line_error(r: subprocess.CompletedProcess[bytes], code: int) -> str:
    """The command failed with ``code``, said why on one stderr line, and
    printed no traceback."""
    err = r.stderr.decode()
    assert r.returncode == code, text(r)
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 or code == 2, err  # argparse prints its usage line too
    assert lines[-1].startswith("mesh"), err
    return lines[-1]


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``mesh`` run in this process (``mesh.cli.main``): its exit status,
    stdout and stderr."""
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's usage errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err
