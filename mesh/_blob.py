"""Big payloads stored out of line (protocol version 10: see "Big payloads out
of line" in ``protocol/README.md``).

A payload longer than :data:`BLOB_MIN` lives in ``{ns}:blob:<sha1hex>`` (a
hash: ``d`` the payload, ``n`` the entries that reference it), uploaded by
``put_blob.lua`` before the call that enqueues it; every entry of a queue holds
its *stand-in*, a pure function of the payload::

    b"\\0mesh-blob\\0" + sha1hex + b"\\0" + size + b"\\0" + first 256 bytes

so that cancel by payload, persistent-task identity and dedup compare equal
strings, and a listing reads a few hundred bytes per job. The scripts count
the references; the worker turns a claimed stand-in back into the payload
(:func:`fetch`) before its handler runs.

The pure part (:func:`standin`, :func:`parse_standin`, :func:`check_payload`)
does no I/O; :func:`fetch` reads a blob (the upload is the binding's
``put_blobs``, one ``put_blob.lua`` call per payload).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import attrs

from ._errors import MeshError
from ._eval import Executor
from ._keys import Keys

__all__ = [
    "BLOB_MARK",
    "BLOB_MIN",
    "BlobGoneError",
    "Standin",
    "check_payload",
    "fetch",
    "is_standin",
    "parse_standin",
    "payload_size",
    "standin",
    "stored",
    "standins",
]

#: Payloads longer than this many bytes (1 MiB) are stored out of line: a
#: protocol constant that every peer uses.
BLOB_MIN = 1048576
#: What every stand-in starts with; no task payload may.
BLOB_MARK = b"\0mesh-blob\0"
#: Bytes of the payload a stand-in carries (its preview).
BLOB_HEAD = 256


class BlobGoneError(MeshError):
    """A claimed big payload's blob is gone (deleted behind the mesh's back,
    or lost with Redis data): the attempt fails with this error; the stand-in
    never reaches a handler."""


@attrs.frozen
class Standin:
    """What a stand-in says of its payload.

    Attributes:
        sha: the payload's SHA-1, 40 hex digits.
        size: the payload's size in bytes.
        head: its first bytes (at most :data:`BLOB_HEAD`).
    """

    sha: str
    size: int
    head: bytes


def is_standin(p: bytes) -> bool:
    """Whether ``p`` is a stand-in (starts with :data:`BLOB_MARK`)."""
    return p[:1] == b"\0" and p[:11] == BLOB_MARK


def check_payload(p: bytes) -> bytes:
    """``p``, unless it starts with :data:`BLOB_MARK`.

    Raises:
        ValueError: it does (such a payload would read as a stand-in).
    """
    if is_standin(p):
        raise ValueError(
            "task payload starts with b'\\x00mesh-blob\\x00', the mark of a payload "
            "stored out of line: no task may start so"
        )
    return p


def standin(payload: bytes) -> bytes:
    """What a queue holds for ``payload``: the payload itself up to
    :data:`BLOB_MIN` bytes, else its stand-in."""
    if len(payload) <= BLOB_MIN:
        return payload
    sha = hashlib.sha1(payload).hexdigest().encode()
    return BLOB_MARK + sha + b"\0%d\0" % len(payload) + payload[:BLOB_HEAD]


def standins(payloads: Sequence[bytes]) -> list[bytes]:
    """:func:`standin` of each."""
    return [p if len(p) <= BLOB_MIN else standin(p) for p in payloads]


def parse_standin(p: bytes) -> Standin | None:
    """What stand-in ``p`` says (its head cut where ``p`` is cut: a preview
    of a stand-in is parsed as far as it goes), or None when ``p`` is not a
    stand-in (or too short a preview of one to tell its size)."""
    if not is_standin(p):
        return None
    end = p.find(b"\0", 52)
    if len(p) < 52 or p[51:52] != b"\0" or end < 0 or not p[52:end].isdigit():
        return None
    return Standin(p[11:51].decode(), int(p[52:end]), p[end + 1 :])


def stored(p: bytes) -> bytes:
    """What a queue holds for the payload a caller names with ``p``: ``p``
    itself when it is a stand-in (a read gave it: :meth:`Client.tasks`,
    :meth:`Client.dead_letters`, a reconcile's cancelled tasks), else
    :func:`standin` of it. For the calls that name a task (cancel, a dead
    letter's requeue or purge, a job's record, a result), never for those
    that add one.

    Raises:
        ValueError: ``p`` starts with :data:`BLOB_MARK` but is no stand-in.
    """
    if is_standin(p):
        if parse_standin(p) is None:
            raise ValueError(
                "task payload starts with b'\\x00mesh-blob\\x00' but is no stand-in of a "
                "big payload: no task may start so"
            )
        return p
    return standin(p)


def payload_size(p: bytes) -> int:
    """The size of the payload that a queue's entry ``p`` holds or stands for."""
    s = parse_standin(p)
    return len(p) if s is None else s.size


async def fetch(conn: Executor, keys: Keys, p: bytes) -> bytes:
    """The payload whose stand-in is ``p`` (one ``HGET``).

    Raises:
        BlobGoneError: its blob is gone.
        MeshConnectionError: Redis could not be reached.

    A read only: cancelled, it leaves nothing behind.
    """
    s = parse_standin(p)
    if s is None:
        return p
    got = await conn.execute("HGET", keys.blob(s.sha), "d")
    if got is None:
        raise BlobGoneError(
            f"the big payload {s.sha} ({s.size} bytes) is gone from Redis "
            f"({keys.blob(s.sha)} does not exist): it cannot run"
        )
    return bytes(got)
