"""What every benchmark gets: the options of the run, and where to report progress."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ._node import NodePeer, prepare_bullmq, prepare_worqr
from ._util import REPO

PEERS_VENV = (
    Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trio-mesh" / "bench-peers"
)
PEER_CHILD = REPO / "bench" / "children" / "peer_child.py"


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class Context:
    runs: int = 3
    quick: bool = False
    peers_python: str | None = None
    peers: bool = True  # throughput: run SAQ, arq and streaQ too
    base: str = ""  # throughput, latency: trio-mesh at this source tree too, same run
    groups_jobs: int = 0  # groups: the cost figure's jobs per side (0: the suite's size)
    log: Callable[[str], None] = field(default=_stderr)
    _peer_versions: dict[str, str | None] = field(default_factory=dict)
    _node: dict[str, tuple[NodePeer | None, str]] = field(default_factory=dict)

    def worqr(self) -> tuple[NodePeer | None, str]:
        """Worqr installed and runnable (installed once per run, see
        :mod:`bench._node`), or None and the note saying why not."""
        if "worqr" not in self._node:
            self._node["worqr"] = prepare_worqr()
        return self._node["worqr"]

    def bullmq(self) -> tuple[NodePeer | None, str]:
        """BullMQ installed and runnable (see :mod:`bench._node`), or None
        and the note saying why not."""
        if "bullmq" not in self._node:
            self._node["bullmq"] = prepare_bullmq()
        return self._node["bullmq"]

    def peer_python(self) -> str:
        """The interpreter for the peers: ``--peers-python``, else the peers'
        virtual environment made by ``python -m bench --setup-peers``, else
        this interpreter."""
        if self.peers_python:
            return self.peers_python
        venv_python = PEERS_VENV / "bin" / "python"
        if venv_python.exists():
            return str(venv_python)
        return sys.executable

    def peer_version(self, lib: str) -> str | None:
        """``"<version> <redis client>-<version>"`` of a peer, or None if it
        cannot be imported by :meth:`peer_python`."""
        if lib not in self._peer_versions:
            try:
                r = subprocess.run(
                    [self.peer_python(), str(PEER_CHILD), lib, "version"],
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                line = r.stdout.strip()
                self._peer_versions[lib] = (
                    line.removeprefix("version ") if r.returncode == 0 and line else None
                )
            except (OSError, subprocess.TimeoutExpired):
                self._peer_versions[lib] = None
        return self._peer_versions[lib]
