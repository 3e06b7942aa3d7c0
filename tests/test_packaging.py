"""The built wheel carries the protocol: its scripts load and run from the
installed package, not from the source checkout."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mesh.testing import RedisServer

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import sys, trio, mesh, mesh._scripts as s
assert "{site}" in mesh.__file__, mesh.__file__
src = str(s._protocol_dir())
assert "{site}" in src and "/work" not in src.replace("{site}", ""), src
async def main():
    async with mesh.open_client(sys.argv[1], namespace="wheel") as c:
        assert await c.ensure("q", "from the wheel")
        print(await c.tasks("q"))
trio.run(main)
"""


@pytest.mark.slow
def test_the_wheel_runs_scripts_from_its_own_protocol_files(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    out = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = out.glob("trio_mesh-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    lua = {Path(n).name for n in names if n.startswith("mesh/protocol/")}
    assert lua >= {p.name for p in (ROOT / "protocol").glob("*.lua")} | {"README.md"}
    assert "mesh/py.typed" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # a clean interpreter that sees the wheel's files and our dependencies, but
    # not the checkout (cwd elsewhere, no editable finder: -S skips site hooks)
    deps = [p for p in sys.path if p.endswith("site-packages")]
    env = {"PYTHONPATH": ":".join([str(site), *deps]), "PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [sys.executable, "-S", "-c", SCRIPT.format(site=site), redis_server.url],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[b'from the wheel']"
