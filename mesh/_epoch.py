"""The namespace's epoch: a marker that tells a master holding the namespace from
one that lost it (restarted empty, or another Redis), checked on every connect.

``{ns}:epoch`` holds a random value written once, by the first process that
connects to a namespace that has none (``SET NX``: every process then reads the
winner's). Each process remembers the value it found on its first connect. On
every later connect (a reconnect, a re-route, a failover) the node must hold the
same value:

* On Sentinel and Cluster, a node that lacks it (an old master restarted empty
  while the sentinels still name it, a node that lost its data) is **refused**: the
  connect fails with a :class:`~mesh.MeshConnectionError` saying so (logged once
  per outage at ERROR), and the reconnect loop tries again until the topology
  names a node that has it (the promoted replica) or an operator adopts the node's
  namespace (:func:`adopt_value`, ``mesh adopt-namespace``).
* On a single server (``redis://``, ``unix://``) there is no other copy to wait
  for: the loss is logged once at ERROR ("started over from empty") and the
  process goes on with the new epoch (the workers find their leases gone and
  rejoin, as documented in docs/reliability.md).

A value written by an operator (``adopted:<hex>``) is accepted by every process,
whatever it remembered, and remembered from then on.

Sans-IO: :class:`Epoch` makes the commands to send with the handshake and judges
their replies; the topology sends them.

Errors: a user whose ACL forbids ``GET``/``SET`` on the key is not checked (the
replies are errors): it is let through.

``mesh status``, the dashboard and the exporter look without writing it: their
connections, opened inside :func:`observing`, only read the epoch (an
observer that wrote a fresh one into a master that restarted empty would
hide the loss from the next look, and turn the workers' "missing" into
"differs"). What they say about it (:func:`epoch_missing`) is judged here
too, from what this process's :class:`Epoch` saw at its connects and from a
``GET`` of the key with their reads (:mod:`mesh._view`).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import secrets
from collections.abc import Iterator, Sequence
from typing import Any, Final

from ._errors import CommandError, MeshConnectionError
from ._transport import Arg

__all__ = ["ADOPTED", "EPOCH_MISSING_HINT", "Epoch", "adopt_value", "epoch_missing", "observing"]

log = logging.getLogger("mesh.connection")

#: The prefix of an epoch an operator wrote: accepted by every process.
ADOPTED: Final = b"adopted:"


# What was last said about each epoch key in this process: a client and a
# worker of one process that meet the same lost namespace say it once.
_said: dict[str, str] = {}


def _say_once(level: int, key: str, message: str) -> None:
    if _said.get(key) != message:
        _said[key] = message
        log.log(level, "%s", message)


_observing: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "mesh_epoch_observing", default=False
)


@contextlib.contextmanager
def observing() -> Iterator[None]:
    """Connections whose topology is built inside this block (in this trio
    task and the ones it starts) read the namespace's epoch and never write
    it: for tools that look at a mesh (``mesh status``, the dashboard, the
    exporter), so that a missing epoch stays missing, and said, until a
    worker or an operator writes it."""
    token = _observing.set(True)
    try:
        yield
    finally:
        _observing.reset(token)


def adopt_value() -> bytes:
    """A fresh epoch value that every process accepts (the operator's step)."""
    return ADOPTED + secrets.token_hex(8).encode()


class Epoch:
    """The epoch one process remembers for one namespace.

    Args:
        key: the namespace's ``{ns}:epoch`` key.
        strict: refuse a node without the remembered epoch (Sentinel, Cluster);
            otherwise, log and go on with the node's (a single server).
    """

    def __init__(self, key: str, *, strict: bool) -> None:
        self.key = key
        self.strict = strict
        self.known: bytes | None = None
        self._complained = False
        self.observer = _observing.get()
        """Only read the epoch, never write it (see :func:`observing`)."""
        self.refused = False
        """This process's last connect was refused: the node lacked the
        epoch this process knew (strict only)."""

    def commands(self) -> list[Sequence[Arg]]:
        """What to send with the handshake: ``SET NX`` of a fresh value (only
        while nothing is remembered, or on a single server, where a lost
        namespace is taken over), then ``GET``; an observer only ``GET``."""
        if self.observer:
            return [("GET", self.key)]
        if self.known is None or not self.strict:
            fresh = secrets.token_hex(8)
            return [("SET", self.key, fresh, "NX"), ("GET", self.key)]
        return [("GET", self.key)]

    def check(self, replies: Sequence[Any], where: str) -> None:
        """Judge the replies of :meth:`commands` from the node ``where``.

        Raises:
            MeshConnectionError: strict, and the node lacks the epoch this
                process knew (the message says what to do).
        """
        value = replies[-1] if replies else None
        if isinstance(value, CommandError) or (
            replies and isinstance(replies[0], CommandError) and value is None
        ):
            return  # refused by ACL (or a replica's READONLY): not checked here
        if value is not None and not isinstance(value, bytes):
            return
        self.refused = False
        known = self.known
        if known is None or value == known:
            self.known = value
            self._complained = False
            return
        if value is not None and value.startswith(ADOPTED):
            _say_once(
                logging.WARNING,
                self.key,
                f"{where}: the namespace's epoch {self.key} was adopted by an operator; "
                "following it",
            )
            self.known = value
            self._complained = False
            return
        what = "is missing" if value is None else "differs"
        if not self.strict:
            _say_once(
                logging.ERROR,
                self.key,
                f"{where} does not hold the namespace this process was using (its epoch "
                f"{self.key} {what}): it started over from empty (a restart without "
                "persistence?) and what it held is lost; going on with it (a single "
                "server: nowhere else to go)",
            )
            self.known = value
            self._complained = False
            return
        message = (
            f"{where} does not hold the namespace this process was using (its epoch "
            f"{self.key} {what}): a master restarted empty, or another Redis; refused "
            "until the topology names a node that holds it, or an operator adopts this "
            "one (`mesh adopt-namespace`, Client.adopt_namespace)"
        )
        self.refused = True
        if not self._complained:
            self._complained = True
            _say_once(logging.ERROR, self.key, message)
        raise MeshConnectionError(message)


def epoch_missing(epoch: Epoch | None, value: object) -> bool:
    """Whether to say that the namespace's epoch is missing (``mesh status``,
    the dashboard, the exporter's ``mesh_namespace_epoch_missing``): the
    key is not there now (``value``, a ``GET`` with the caller's reads, is
    None), or this process's last connect was refused a node that lacks
    it. Sync, no I/O.

    ``value`` an error (an ACL that forbids ``GET``): not known, so not said.
    """
    if epoch is not None and epoch.refused:
        return True
    return value is None


#: What to do about it, in every place that says so.
EPOCH_MISSING_HINT = (
    "a new namespace, or a master that restarted empty: workers that ran here refuse it "
    "(their log says so) until `mesh adopt-namespace` (docs/operating.md, 'A master "
    "restarted empty')"
)
