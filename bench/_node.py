"""The Node peers of the throughput benchmark, Worqr and BullMQ: find node and
npm, install each into a scratch folder once, and build the argv of its driver
(``bench/children/worqr_driver.js``, ``bench/children/bullmq_driver.js``).

Worqr 1.2.3 is not in the npm registry these machines reach; a tarball built
from its public source is (see ``shared/peers/README.md`` beside the
repository). It is found at ``$BENCH_WORQR_TGZ``, else at
``shared/peers/worqr-1.2.3.tgz`` in the repository's parent folder or one of
its parents. Its dependencies (the ``redis`` 2.8 client, ``debug``, ``uuid``)
come from the npm registry. BullMQ (``bullmq@6.7.0`` and its ``ioredis``)
and ``ioredis`` (its
default client, an optional peer dependency) come from the npm registry.

Each install is kept in ``~/.cache/trio-mesh/bench-<peer>/<key>``
(``$XDG_CACHE_HOME`` if set; the key is the tarball's sha256 prefix or the
version) and reused while it is the same.

Nothing here raises for a missing piece: :func:`prepare_worqr` and
:func:`prepare_bullmq` return the reason, and the benchmark skips the peer
with that note.
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

CHILDREN = REPO / "bench" / "children"
TARBALL = "worqr-1.2.3.tgz"
BULLMQ = "bullmq@6.7.0"
IOREDIS = "ioredis@6.0.0"  # an optional peer dependency of bullmq 6, its default client
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trio-mesh"


@dataclass(frozen=True)
class NodePeer:
    node: str
    driver: Path
    modules: Path  # holds node_modules/<peer>
    version: str  # "<peer version> <redis client>-<client version>"

    def argv(self, role: str, *args: str) -> list[str]:
        return [self.node, str(self.driver), str(self.modules), role, *args]


def find_tarball() -> Path | None:
    env = os.environ.get("BENCH_WORQR_TGZ")
    if env:
        return Path(env) if Path(env).is_file() else None
    for d in REPO.parents:
        p = d / "shared" / "peers" / TARBALL
        if p.is_file():
            return p
    return None


def _install(
    name: str, specs: list[str], package: str, modules: Path, driver: Path
) -> tuple[NodePeer | None, str]:
    """``npm install *specs`` into ``modules`` (unless there already), then ask
    the driver for its version: the peer, or None and a one-line note."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        return None, f"{name} skipped: node and npm are needed (not found on PATH)"
    if not (modules / "node_modules" / package / "package.json").is_file():
        modules.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix="install-", dir=modules.parent))
        try:
            for cmd in (
                [npm, "init", "-y"],
                [npm, "install", "--no-audit", "--no-fund", "--loglevel=error", *specs],
            ):
                r = subprocess.run(cmd, cwd=scratch, capture_output=True, text=True, timeout=300)
                if r.returncode != 0:
                    last = (r.stderr.strip().splitlines() or ["no output"])[-1]
                    return None, f"{name} skipped: `{' '.join(cmd[:2])}` failed: {last}"
            shutil.rmtree(modules, ignore_errors=True)
            scratch.rename(modules)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"{name} skipped: installing {Path(specs[0]).name} failed: {exc}"
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    try:
        r = subprocess.run(
            [node, str(driver), str(modules), "version"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{name} skipped: its driver does not start: {exc}"
    line = r.stdout.strip()
    if r.returncode != 0 or not line.startswith("version "):
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"{name} skipped: its driver does not start: {last}"
    return NodePeer(node, driver, modules, line.removeprefix("version ")), ""


def prepare_worqr() -> tuple[NodePeer | None, str]:
    """Worqr ready to run, or None and why not (a one-line note)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        return None, "Worqr skipped: node and npm are needed (not found on PATH)"
    tgz = find_tarball()
    if tgz is None:
        return None, (
            f"Worqr skipped: {TARBALL} not found ($BENCH_WORQR_TGZ, or shared/peers/ "
            "in a parent folder of the repository)"
        )
    sha = hashlib.sha256(tgz.read_bytes()).hexdigest()
    modules = CACHE / "bench-worqr" / sha[:16]
    return _install("Worqr", [str(tgz)], "worqr", modules, CHILDREN / "worqr_driver.js")


def prepare_bullmq() -> tuple[NodePeer | None, str]:
    """BullMQ ready to run (installed from the npm registry), or None and why
    not (a one-line note: no node, no registry)."""
    modules = CACHE / "bench-bullmq" / f"{BULLMQ.split('@')[1]}-{IOREDIS.split('@')[1]}"
    return _install("BullMQ", [BULLMQ, IOREDIS], "bullmq", modules, CHILDREN / "bullmq_driver.js")
