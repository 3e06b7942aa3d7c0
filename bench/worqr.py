"""Worqr (Node) as a peer of the throughput benchmark: find node, npm and the
Worqr tarball, install it into a scratch folder, and build the argv of
``bench/worqr_driver.js``.

Worqr 1.2.3 is not in the npm registry these machines reach; a tarball built
from its public source is (see ``shared/peers/README.md`` beside the
repository). It is found at ``$BENCH_WORQR_TGZ``, else at
``shared/peers/worqr-1.2.3.tgz`` in the repository's parent folder or one of
its parents. Its dependencies (the ``redis`` 2.8 client, ``debug``, ``uuid``)
come from the npm registry, once: the install is kept in
``~/.cache/trio-mesh/bench-worqr/<tarball sha256 prefix>`` (``$XDG_CACHE_HOME``
if set) and reused while the tarball is the same.

Nothing here raises for a missing piece: :func:`prepare` returns the reason,
and the benchmark skips Worqr with that note.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ._util import REPO

TARBALL = "worqr-1.2.3.tgz"
DRIVER = REPO / "bench" / "worqr_driver.js"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trio-mesh" / "bench-worqr"


@dataclass(frozen=True)
class Worqr:
    node: str
    modules: Path  # holds node_modules/worqr
    version: str  # "<worqr version> redis-<client version>"

    def argv(self, role: str, *args: str) -> list[str]:
        return [self.node, str(DRIVER), str(self.modules), role, *args]


def find_tarball() -> Path | None:
    env = os.environ.get("BENCH_WORQR_TGZ")
    if env:
        return Path(env) if Path(env).is_file() else None
    for d in REPO.parents:
        p = d / "shared" / "peers" / TARBALL
        if p.is_file():
            return p
    return None


def prepare() -> tuple[Worqr | None, str]:
    """Worqr ready to run, or None and why not (a one-line note)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        return None, "Worqr skipped: node and npm are needed (not found on PATH)"
    tgz = find_tarball()
    if tgz is None:
        return None, (
            f"Worqr skipped: {TARBALL} not found ($BENCH_WORQR_TGZ, or shared/peers/ "
            "in a parent folder of the repository)"
        )
    sha = hashlib.sha256(tgz.read_bytes()).hexdigest()
    modules = CACHE / sha[:16]
    if not (modules / "node_modules" / "worqr" / "package.json").is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix="install-", dir=CACHE))
        try:
            for cmd in (
                [npm, "init", "-y"],
                [npm, "install", "--no-audit", "--no-fund", "--loglevel=error", str(tgz)],
            ):
                r = subprocess.run(cmd, cwd=scratch, capture_output=True, text=True, timeout=300)
                if r.returncode != 0:
                    last = (r.stderr.strip().splitlines() or ["no output"])[-1]
                    return None, f"Worqr skipped: `{' '.join(cmd[:2])}` failed: {last}"
            shutil.rmtree(modules, ignore_errors=True)
            scratch.rename(modules)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"Worqr skipped: installing {tgz.name} failed: {exc}"
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    r = subprocess.run(
        [node, str(DRIVER), str(modules), "version"], capture_output=True, text=True, timeout=60
    )
    line = r.stdout.strip()
    if r.returncode != 0 or not line.startswith("version "):
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"Worqr skipped: its driver does not start: {last}"
    return Worqr(node, modules, line.removeprefix("version ")), ""
