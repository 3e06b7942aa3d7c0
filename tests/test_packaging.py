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


EDITABLE = """
import sys, setuptools.build_meta as b
print(b.build_editable(sys.argv[1]))
"""

TYPED = """
import mesh
import mesh.testing

async def main() -> None:
    async with mesh.open_client("redis://127.0.0.1:1") as client:
        n: int = await client.enqueue_many("q", [b"x"])
        print(n + 1)
"""


@pytest.mark.slow
def test_an_editable_install_is_visible_to_type_checkers(tmp_path: Path) -> None:
    # What `pip install -e .` installs: setuptools' editable wheel (PEP 660).
    # With an import hook in it, mypy cannot find `mesh` ("Cannot find
    # implementation or library stub"): it must be a plain path in a .pth.
    out = tmp_path / "dist"
    out.mkdir()
    r = subprocess.run(
        [sys.executable, "-c", EDITABLE, str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    (wheel,) = out.glob("trio_mesh-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.endswith("_finder.py")], names
    (pth,) = [n for n in names if n.endswith(".pth")]
    assert zipfile.ZipFile(wheel).read(pth).decode().split() == [str(ROOT)]
    # A fresh environment with that editable install and our dependencies (a
    # path line: the .pth files of this venv, its own editable install
    # included, are not run), and mypy run from elsewhere, as a user would.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = venv.glob("lib/python3*/site-packages")
    zipfile.ZipFile(wheel).extractall(site)
    deps = [p for p in sys.path if p.endswith("site-packages")]
    (site / "deps.pth").write_text("\n".join(deps) + "\n")
    (tmp_path / "app.py").write_text(TYPED)
    r = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "mypy", "--strict", "--no-incremental", "app.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Success" in r.stdout
    # and the interpreter of that environment runs the package from the checkout
    r = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import mesh._scripts as s; print(s._protocol_dir())"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert str(ROOT) in r.stdout
