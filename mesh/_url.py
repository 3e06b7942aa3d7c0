"""Redis URLs: parse standalone, Sentinel and Cluster URLs into a :class:`RedisConfig`.

Accepted forms::

    redis://[[user]:password@]host[:port][/db][?connect_timeout=SECONDS]
    rediss://[[user]:password@]host[:port][/db][?ssl_cert_reqs=none|required][&ssl_ca_certs=PATH]
            [&ssl_certfile=PATH[&ssl_keyfile=PATH]]   (a client certificate and its key)
    unix://[[user]:password@]/path/to/redis.sock[?db=N][&connect_timeout=SECONDS]
    redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/SERVICE[/db]
    rediss+sentinel://...                       (TLS to the sentinels and the master)
    redis+cluster://[[user]:password@]host[:port][,host[:port]...]   (seed nodes; db 0 only)
    rediss+cluster://...                        (TLS)

A plain ``redis://`` URL that names any node of a Redis Cluster works too: the
cluster is detected at connect (its db must be 0). Sentinel ports default to
26379, every other port to 6379.

User and password are percent-decoded; they are the data nodes' credentials (the
master's). When the URL has no password, ``$MESH_REDIS_PASSWORD`` (and, if the URL
has no user, ``$MESH_REDIS_USERNAME``) are used, so that secrets can stay out of
command lines. ``min_replicas=N`` (any form) makes workers and clients confirm
their guarantee-carrying writes with ``WAIT N`` (see ``docs/guarantees.md``).
The sentinels' own credentials, if they need any, come from the
query parameters ``sentinel_username`` and ``sentinel_password`` or, better, from
``$MESH_SENTINEL_PASSWORD`` (and ``$MESH_SENTINEL_USERNAME``).

No error message, no ``str`` and no ``repr`` ever contains a password.
"""

from __future__ import annotations

import math
import os
import re
from typing import Literal
from urllib.parse import parse_qsl, quote, unquote, urlsplit

import attrs

from ._errors import ConfigError

__all__ = ["RedisConfig", "check_min_replicas", "coerce_config", "parse_url"]

_SCHEMES = (
    "redis",
    "rediss",
    "unix",
    "redis+sentinel",
    "rediss+sentinel",
    "redis+cluster",
    "rediss+cluster",
)
_QUERY_KEYS = frozenset(
    {
        "db",
        "connect_timeout",
        "ssl_cert_reqs",
        "ssl_ca_certs",
        "ssl_certfile",
        "ssl_keyfile",
        "sentinel_username",
        "sentinel_password",
        "min_replicas",
    }
)
_SENTINEL_PORT = 26379
_QUERY_SECRET = re.compile(r"(sentinel_password=)[^&#]*", re.IGNORECASE)

Topology = Literal["standalone", "sentinel", "cluster"]


@attrs.frozen
class RedisConfig:
    """Where and how to connect to Redis. Build one with :func:`parse_url` or directly.

    ``path`` set means a unix socket (``host`` and ``port`` are then unused).
    ``topology`` says how the master is found: ``"standalone"`` (``host``/``port``,
    which may turn out to be a cluster node: detected at connect), ``"sentinel"``
    (ask the sentinels ``nodes`` for the master ``service``) or ``"cluster"`` (the
    seed ``nodes``). For those two, ``host``/``port`` are the first of ``nodes``.
    Passwords are left out of ``repr`` and ``str``; use :meth:`redacted` in logs
    and messages.
    """

    host: str = "127.0.0.1"
    port: int = 6379
    path: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = attrs.field(default=None, repr=False)
    tls: bool = False
    tls_verify: bool = True
    tls_ca_file: str | None = None
    connect_timeout: float = 5.0
    topology: Topology = "standalone"
    nodes: tuple[tuple[str, int], ...] = ()
    service: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = attrs.field(default=None, repr=False)
    min_replicas: int = 0
    #: A client certificate (PEM) for a server that asks for one
    #: (``tls-auth-clients``), and its private key (PEM, not encrypted; None:
    #: in the certificate file). ``tls`` only. Paths, never shown with secrets.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None

    def __str__(self) -> str:
        return self.redacted()

    def redacted(self) -> str:
        """A URL for this config that is safe to log: passwords are shown as ``***``.

        Returns:
            For example ``redis://alice:***@[::1]:6380/2``, ``unix:///run/redis.sock?db=1``
            or ``redis+sentinel://:***@h1:26379,h2:26379/mymaster/0``.
        """
        userinfo = ""
        if self.username is not None or self.password is not None:
            user = quote(self.username, safe="") if self.username else ""
            userinfo = user + (":***" if self.password is not None else "") + "@"
        if self.path is not None:
            query = f"?db={self.db}" if self.db else ""
            return f"unix://{userinfo}{quote(self.path)}{query}"
        scheme = "rediss" if self.tls else "redis"
        if self.topology == "standalone":
            return f"{scheme}://{userinfo}{_hostport(self.host, self.port)}/{self.db}"
        hosts = ",".join(_hostport(h, p) for h, p in self.nodes or ((self.host, self.port),))
        if self.topology == "cluster":
            return f"{scheme}+cluster://{userinfo}{hosts}"
        params = []
        if self.sentinel_username is not None:
            params.append(f"sentinel_username={quote(self.sentinel_username, safe='')}")
        if self.sentinel_password is not None:
            params.append("sentinel_password=***")
        query = "?" + "&".join(params) if params else ""
        service = quote(self.service or "", safe="")
        return f"{scheme}+sentinel://{userinfo}{hosts}/{service}/{self.db}{query}"


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _scrub(url: str) -> str:
    """``url`` with its whole userinfo (user and password) replaced by ``***``.

    Used in parse errors: a malformed URL may have a password where a user name
    belongs (``redis://secret@host``), so neither part is shown.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        # No authority part we can find: show only the scheme-ish prefix, never the rest,
        # since we cannot tell where a password would be.
        return "<unparseable URL>"
    end = len(rest)
    for ch in "/?#":
        i = rest.find(ch)
        if i != -1:
            end = min(end, i)
    netloc, tail = rest[:end], rest[end:]
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    tail = _QUERY_SECRET.sub(r"\1***", tail)
    return f"{scheme}://{netloc}{tail}"


def parse_url(url: str) -> RedisConfig:
    """Parse a Redis URL.

    Args:
        url: a standalone, Sentinel or Cluster URL (see the module docstring).
            Surrounding whitespace is ignored.

    Returns:
        The parsed configuration.

    Raises:
        ConfigError: the URL is malformed; the one-line message names the part that
            is wrong (scheme, host list, service, port, db, query parameter...) and
            never contains a password.
    """
    if not isinstance(url, str):
        raise ConfigError(f"a Redis URL must be a str, not {type(url).__name__}")
    url = url.strip()
    shown = _scrub(url)
    secrets: list[str] = []

    def fail(what: str) -> ConfigError:
        msg = f"bad Redis URL {shown}: {what}"
        for secret in secrets:
            msg = msg.replace(secret, "***")
        return ConfigError(msg)

    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. an unbalanced '[' in an IPv6 host
        raise fail(f"cannot parse it ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise fail(
            f"unsupported scheme {scheme + '://' if scheme else '(none)'}; use redis://, "
            "rediss://, unix://, redis+sentinel://, rediss+sentinel://, redis+cluster:// "
            "or rediss+cluster://"
        )
    if parts.fragment:
        raise fail("unexpected #fragment")
    base, _, kind = scheme.partition("+")
    topology: Topology = "standalone" if not kind else kind  # type: ignore[assignment]

    # -- credentials
    netloc = parts.netloc
    userinfo, at, hostport = netloc.rpartition("@")
    if not at:
        userinfo, hostport = "", netloc
    username: str | None = None
    password: str | None = None
    if userinfo:
        user_raw, colon, pass_raw = userinfo.partition(":")
        username = unquote(user_raw) or None
        password = unquote(pass_raw) if colon and pass_raw else None
        if password:
            secrets.append(password)
    if password is None:
        password = os.environ.get("MESH_REDIS_PASSWORD") or None
        if password is not None:
            secrets.append(password)
        if password is not None and username is None:
            username = os.environ.get("MESH_REDIS_USERNAME") or None
    if username is not None and password is None:
        raise fail(
            "it has a user name but no password (and $MESH_REDIS_PASSWORD is not set); "
            "for a password alone write redis://:PASSWORD@host"
        )

    # -- query
    query: dict[str, str] = {}
    try:
        pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False)
    except ValueError as exc:
        raise fail(f"bad query string ({exc})") from None
    for key, value in pairs:
        if key == "sentinel_password" and value:
            secrets.append(value)
    for key, value in pairs:
        if key not in _QUERY_KEYS:
            raise fail(f"unknown query parameter {key!r} (known: {', '.join(sorted(_QUERY_KEYS))})")
        if key in query:
            raise fail(f"query parameter {key!r} given twice")
        query[key] = value

    connect_timeout = 5.0
    if "connect_timeout" in query:
        try:
            connect_timeout = float(query["connect_timeout"])
        except ValueError:
            connect_timeout = math.nan
        if not (connect_timeout > 0 and math.isfinite(connect_timeout)):
            raise fail(
                f"connect_timeout must be a positive number of seconds, "
                f"not {query['connect_timeout']!r}"
            )

    min_replicas = 0
    if "min_replicas" in query:
        text = query["min_replicas"]
        if not (text.isascii() and text.isdigit()) or int(text) > 1000:
            raise fail(f"min_replicas must be an integer from 0 to 1000, not {text!r}")
        min_replicas = int(text)

    tls = base == "rediss"
    tls_verify = True
    tls_ca_file: str | None = None
    tls_keys = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
    if not tls and any(k in query for k in tls_keys):
        raise fail(
            "ssl_cert_reqs, ssl_ca_certs, ssl_certfile and ssl_keyfile are only valid with "
            "rediss:// (or rediss+...)"
        )
    tls_cert_file = query.get("ssl_certfile")
    tls_key_file = query.get("ssl_keyfile")
    for name, given in (("ssl_certfile", tls_cert_file), ("ssl_keyfile", tls_key_file)):
        if given == "":
            raise fail(f"{name} is empty")
    if tls_key_file is not None and tls_cert_file is None:
        raise fail("ssl_keyfile needs ssl_certfile (the client certificate it belongs to)")
    if "ssl_cert_reqs" in query:
        reqs = query["ssl_cert_reqs"].lower()
        if reqs == "none":
            tls_verify = False
        elif reqs not in ("required", "optional"):
            raise fail(
                f"ssl_cert_reqs must be none, optional or required, not {query['ssl_cert_reqs']!r}"
            )
    if "ssl_ca_certs" in query:
        if not query["ssl_ca_certs"]:
            raise fail("ssl_ca_certs is empty")
        tls_ca_file = query["ssl_ca_certs"]

    sentinel_username: str | None = None
    sentinel_password: str | None = None
    if topology == "sentinel":
        sentinel_username = query.get("sentinel_username") or None
        sentinel_password = query.get("sentinel_password") or None
        if sentinel_password is None:
            sentinel_password = os.environ.get("MESH_SENTINEL_PASSWORD") or None
            if sentinel_password is not None:
                secrets.append(sentinel_password)
            if sentinel_password is not None and sentinel_username is None:
                sentinel_username = os.environ.get("MESH_SENTINEL_USERNAME") or None
        if sentinel_username is not None and sentinel_password is None:
            raise fail(
                "sentinel_username given without sentinel_password (nor $MESH_SENTINEL_PASSWORD)"
            )
    elif "sentinel_username" in query or "sentinel_password" in query:
        raise fail("sentinel_username and sentinel_password are only valid with redis+sentinel://")

    # -- database (and the Sentinel service)
    path = parts.path
    db_text: str | None = None
    service: str | None = None
    if topology == "sentinel":
        segments = path.split("/")[1:] if path.startswith("/") else []
        if segments and segments[-1] == "":
            segments.pop()  # a trailing slash
        if not segments or not segments[0]:
            raise fail(
                "no service name; write redis+sentinel://host[:port][,host[:port]...]/SERVICE[/DB]"
            )
        if len(segments) > 2:
            raise fail(f"too many path parts {path!r}; expected /SERVICE[/DB]")
        service = unquote(segments[0])
        if len(segments) == 2:
            db_text = segments[1]
    elif scheme != "unix":
        stripped = path[1:] if path.startswith("/") else path
        if stripped:
            db_text = stripped
    if "db" in query:
        if db_text is not None and db_text != query["db"]:
            raise fail(f"db given twice (path /{db_text} and ?db={query['db']})")
        db_text = query["db"]
    db = 0
    if db_text is not None:
        if not (db_text.isascii() and db_text.isdigit()):
            raise fail(f"db must be a non-negative integer, not {db_text!r}")
        db = int(db_text)
    if topology == "cluster" and db != 0:
        raise fail(f"a Redis Cluster has only db 0, not {db}")

    # -- address
    if scheme == "unix":
        if hostport:
            raise fail(
                f"a unix:// URL takes no host ({hostport!r}); write unix:///path/to/redis.sock"
            )
        sock_path = unquote(path)
        if not sock_path or sock_path == "/":
            raise fail("no socket path; write unix:///path/to/redis.sock")
        return RedisConfig(
            path=sock_path,
            db=db,
            username=username,
            password=password,
            connect_timeout=connect_timeout,
            min_replicas=min_replicas,
        )

    if topology != "standalone":
        default_port = _SENTINEL_PORT if topology == "sentinel" else 6379
        if not hostport:
            raise fail(f"no host; write {scheme}://host[:port][,host[:port]...]")
        nodes: list[tuple[str, int]] = []
        for item in hostport.split(","):
            if not item:
                raise fail("an empty entry in the host list (two commas, or a trailing comma)")
            node = _parse_hostport(item, default_port)
            if isinstance(node, str):
                raise fail(node)
            nodes.append(node)
        return RedisConfig(
            host=nodes[0][0],
            port=nodes[0][1],
            db=db,
            username=username,
            password=password,
            tls=tls,
            tls_verify=tls_verify,
            tls_ca_file=tls_ca_file,
            connect_timeout=connect_timeout,
            topology=topology,
            nodes=tuple(nodes),
            service=service,
            sentinel_username=sentinel_username,
            sentinel_password=sentinel_password,
            min_replicas=min_replicas,
            tls_cert_file=tls_cert_file,
            tls_key_file=tls_key_file,
        )

    if "," in hostport:
        raise fail(
            "a host list needs redis+sentinel:// or redis+cluster://; redis:// takes one host"
        )
    try:
        port_or_none = parts.port
    except ValueError:
        port_text = hostport.rpartition("]")[2] if hostport.startswith("[") else hostport
        raise fail(
            f"port must be an integer from 1 to 65535, not {port_text.rpartition(':')[2]!r}"
        ) from None
    if port_or_none is not None and not 1 <= port_or_none <= 65535:
        raise fail(f"port must be from 1 to 65535, not {port_or_none}")
    if hostport.endswith(":"):
        raise fail("empty port after ':'")
    host = parts.hostname or "127.0.0.1"
    if hostport.startswith("[") and ":" not in host:
        raise fail(f"brackets are only for IPv6 addresses, not {host!r}")
    return RedisConfig(
        host=host,
        port=port_or_none if port_or_none is not None else 6379,
        db=db,
        username=username,
        password=password,
        tls=tls,
        tls_verify=tls_verify,
        tls_ca_file=tls_ca_file,
        connect_timeout=connect_timeout,
        min_replicas=min_replicas,
        tls_cert_file=tls_cert_file,
        tls_key_file=tls_key_file,
    )


def _parse_hostport(item: str, default_port: int) -> tuple[str, int] | str:
    """``host[:port]`` or ``[v6][:port]``; a string is the reason it is bad."""
    if item.startswith("["):
        host, bracket, rest = item[1:].partition("]")
        if not bracket:
            return f"unbalanced '[' in {item!r}"
        if ":" not in host:
            return f"brackets are only for IPv6 addresses, not {host!r}"
        if rest and not rest.startswith(":"):
            return f"unexpected {rest!r} after {host!r}"
        port_text = rest[1:] if rest else None
    else:
        host, colon, port_text_ = item.rpartition(":")
        if not colon:
            host, port_text = item, None
        else:
            port_text = port_text_
        if ":" in host:
            return f"an IPv6 address needs brackets: [{host}]"
    if not host:
        return f"an empty host in {item!r}"
    if port_text is None:
        return host.lower(), default_port
    if not port_text:
        return "empty port after ':'"
    if not (port_text.isascii() and port_text.isdigit()) or not 1 <= int(port_text) <= 65535:
        return f"port must be an integer from 1 to 65535, not {port_text!r}"
    return host.lower(), int(port_text)


def coerce_config(config: RedisConfig | str) -> RedisConfig:
    """A :class:`RedisConfig` from a config or a URL: how every ``open_*``
    (client, worker, fleet, connection, pub/sub) reads its ``url`` argument,
    once, at its entry; beneath it only a :class:`RedisConfig` travels.

    Raises:
        ConfigError: a malformed URL, or neither a str nor a RedisConfig.
    """
    if isinstance(config, str):
        return parse_url(config)
    if not isinstance(config, RedisConfig):
        raise ConfigError(f"expected a RedisConfig or a URL, not {type(config).__name__}")
    return config


def check_min_replicas(config: RedisConfig, min_replicas: int | None) -> int:
    """``min_replicas`` if given, else the URL's; ConfigError unless an int >= 0."""
    if min_replicas is None:
        return config.min_replicas
    if type(min_replicas) is not int or min_replicas < 0:
        raise ConfigError(f"min_replicas must be an integer >= 0, not {min_replicas!r}")
    return min_replicas
