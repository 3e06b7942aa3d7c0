"""The dashboard's defence against DNS rebinding: a request is served only
when its ``Host`` header names the address the dashboard is bound to, a
loopback name, or a name the operator allowed.

A page on ``evil.example`` whose name is made to resolve to 127.0.0.1 reaches
the dashboard from the victim's own browser, with ``Host: evil.example``; a
check of the ``Host`` header refuses it, before any route runs (the page, the
state and every action alike)."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from .._errors import ConfigError

__all__ = ["HostGate", "allowed_hosts", "check_host_name"]

#: Names a dashboard bound to a loopback address always answers to.
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def check_host_name(name: object) -> str:
    """``name`` lower-cased if it is a host name or an IP address (no port,
    no scheme).

    Raises:
        ConfigError: anything else, named.
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"an allowed host must be a host name or an address, got {name!r}")
    text = name.strip().lower()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        pass
    ok = all(c.isalnum() or c in "-." for c in text) and not text.startswith((".", "-"))
    if not ok or len(text) > 253:
        raise ConfigError(
            f"an allowed host must be a host name or an address without a port, got {name!r}"
        )
    return text


def _bound_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def allowed_hosts(bound: str, extra: Iterable[str] = ()) -> tuple[frozenset[str], bool]:
    """The names a dashboard bound to ``bound`` answers to, and whether any
    IP address is also accepted (bound to every address: ``0.0.0.0`` or
    ``::``, where the machine's own addresses are not known in advance).

    Raises:
        ConfigError: a name of ``extra`` that is not a host name or address.
    """
    names = {check_host_name(n) for n in extra}
    if _bound_wildcard(bound):
        return frozenset(names | set(LOOPBACK_NAMES)), True
    b = check_host_name(bound)
    names.add(b)
    if b in LOOPBACK_NAMES or (_is_ip(b) and ipaddress.ip_address(b).is_loopback):
        names.update(LOOPBACK_NAMES)
    return frozenset(names), False


def _host_name(header: str) -> str | None:
    """The name of a ``Host`` header without its port (None: malformed)."""
    h = header.strip().lower()
    if h.startswith("["):
        end = h.find("]")
        rest = h[end + 1 :]
        if end < 0 or (rest and not (rest[:1] == ":" and rest[1:].isdigit())):
            return None
        return h[1:end]
    name, _, port = h.partition(":")
    if port and not port.isdigit():
        return None
    return name


class HostGate:
    """Refuse (421) every request whose ``Host`` is not one of ``names``
    (or an IP address, with ``any_ip``). Pure ASGI, so streaming responses
    pass through untouched."""

    def __init__(self, app: ASGIApp, names: frozenset[str], *, any_ip: bool = False) -> None:
        self.app = app
        self.names = names
        self.any_ip = any_ip

    def _ok(self, header: str | None) -> bool:
        if header is None:
            return False
        name = _host_name(header)
        if name is None:
            return False
        if name in self.names:
            return True
        if _is_ip(name):
            return self.any_ip or str(ipaddress.ip_address(name)) in self.names
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = None
        for k, v in scope.get("headers", ()):
            if k == b"host":
                host = v.decode("latin-1")
                break
        if self._ok(host):
            await self.app(scope, receive, send)
            return
        shown = (host or "")[:80].encode("ascii", "replace").decode()
        response = PlainTextResponse(
            f"host {shown!r} is not one this dashboard answers to "
            "(allow it with mesh dashboard --allow-host NAME)\n",
            status_code=421,
        )
        await response(scope, receive, send)
