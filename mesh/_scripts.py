"""The protocol's scripts as they are hashed and sent: each ``protocol/NAME.lua``
read once per process, its ``--!include FILE`` lines replaced by the files
they name (``include/NAME.lua``, each spliced once per script: plain text, see
"Loading the scripts" in ``protocol/README.md``), and its SHA-1 (what
``EVALSHA`` names). Running them is :mod:`mesh._eval`.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Mapping
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path

import attrs

from ._errors import ProtocolError

__all__ = ["SCRIPT_NAMES", "Script", "expand_script", "load_scripts"]

SCRIPT_NAMES = (
    "register",
    "serve",
    "heartbeat",
    "claim",
    "finish",
    "finish_claim",
    "give_back",
    "unserve",
    "drain",
    "recycle",
    "reap_check",
    "enqueue",
    "ensure",
    "cancel",
    "delete_queue",
    "delay",
    "dead",
    "configure",
    "finish_results",
    "schedule",
    "fire",
    "rebalance",
    "read",
    "peek",
    "recount",
    "pause",
    "enqueue_group",
    "configure_group",
    "pause_group",
    "stats",
    "put_blob",
)

# An include line, with its line end: the file it names (a path relative to
# protocol/) replaces it.
_INCLUDE = re.compile(rb"^--!include ((?:[A-Za-z0-9_-]+/)*[A-Za-z0-9_-]+\.lua)[ \t]*(?:\n|$)", re.M)


@attrs.frozen
class Script:
    name: str
    source: bytes = attrs.field(repr=False)
    sha: str


def _protocol_dir() -> Traversable:
    try:
        d = resources.files("mesh.protocol")
        if d.joinpath("claim.lua").is_file():
            return d
    except ModuleNotFoundError:
        pass
    # A source checkout used without installing: protocol/ beside mesh/.
    return Path(__file__).resolve().parent.parent / "protocol"


def _expand(d: Traversable, name: str, stack: tuple[str, ...], done: set[str]) -> bytes:
    """The text of ``name`` with every include line replaced by the expanded
    text of the file it names, but for a file already spliced into this
    script (``done``): its line is dropped. Plain text, no parsing of Lua.

    Raises:
        ProtocolError: ``name`` includes itself, directly or not (a cycle).
        FileNotFoundError: ``name`` or a file it includes does not exist.
    """
    if name in stack:
        raise ProtocolError(f"protocol/{name}: include cycle {' -> '.join((*stack, name))}")
    f = d
    for part in name.split("/"):
        f = f.joinpath(part)
    text = f.read_bytes()

    def splice(m: re.Match[bytes]) -> bytes:
        file = m.group(1).decode()
        if file in done:
            return b""
        out = _expand(d, file, (*stack, name), done)
        done.add(file)
        return out

    return _INCLUDE.sub(splice, text)


def expand_script(d: Traversable, name: str) -> bytes:
    """The source of script ``name`` (a path relative to ``d``, the
    protocol directory) as it is hashed and sent: see "Loading the scripts"
    in ``protocol/README.md``.

    Raises:
        ProtocolError: an include cycle.
        FileNotFoundError: the script or a file it includes does not exist.
    """
    return _expand(d, name, (), set())


@functools.cache
def load_scripts() -> Mapping[str, Script]:
    """Read, expand and hash every script (once per process).

    Raises:
        ProtocolError: a script file is missing (a broken install).
    """
    d = _protocol_dir()
    out = {}
    for name in SCRIPT_NAMES:
        try:
            src = expand_script(d, name + ".lua")
        except FileNotFoundError as exc:
            raise ProtocolError(f"protocol script {name}.lua not found in {d}") from exc
        out[name] = Script(name, src, hashlib.sha1(src).hexdigest())
    return out
