"""``mesh dashboard``: serve the live web dashboard (the ``dashboard`` extra)."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys
from types import ModuleType

import anyio
import trio

import mesh
from mesh._epoch import observing

from ._common import CliError, Target, UsageError, add_target_options, positive_float, target
from ._metrics import port_arg

__all__ = ["register"]

log = logging.getLogger("mesh.cli")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``dashboard`` to the ``mesh`` parser."""
    p = sub.add_parser(
        "dashboard",
        help="serve a live web dashboard of the mesh",
        description="Serve a web page that shows the workers, queues, persistent tasks and "
        "their owners, and recent takeovers, updated live, and can cancel a task. Needs the "
        "dashboard extra (pip install 'trio-mesh[dashboard]'). Binds 127.0.0.1 unless --host "
        "says otherwise; any other address needs a token (--token, or $MESH_DASHBOARD_TOKEN "
        "to keep it off the command line). SIGINT or SIGTERM stops it (exit 0).",
    )
    add_target_options(p)
    p.add_argument("--port", type=port_arg, default=8808, help="port (default 8808; 0: any free)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument(
        "--token",
        default=None,
        help="require this bearer token (default $MESH_DASHBOARD_TOKEN); open the page as "
        "http://HOST:PORT/?token=TOKEN",
    )
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="also answer requests whose Host header names NAME (a proxy's name, the "
        "machine's DNS name); others than the bound address and loopback names are refused "
        "(DNS rebinding). Repeatable",
    )
    p.add_argument(
        "--interval",
        type=positive_float,
        default=1.0,
        metavar="S",
        help="seconds between reads of the mesh (default 1)",
    )
    p.set_defaults(func=_dashboard)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _module() -> ModuleType:
    try:
        import mesh.dashboard
    except ImportError:
        raise CliError(
            "the dashboard needs starlette and hypercorn: pip install 'trio-mesh[dashboard]'"
        ) from None
    return mesh.dashboard


def _dashboard(args: argparse.Namespace) -> int:
    t = target(args)
    token = args.token if args.token is not None else os.environ.get("MESH_DASHBOARD_TOKEN")
    if token == "":
        raise UsageError("the token is empty; give a real one, or none on 127.0.0.1")
    if not _loopback(args.host) and not token:
        raise UsageError(
            f"--host {args.host} lets other machines cancel tasks: give --token "
            "(or $MESH_DASHBOARD_TOKEN)"
        )
    m = _module()
    from mesh.dashboard._hosts import check_host_name

    try:
        for name in args.allow_host:
            check_host_name(name)
    except mesh.ConfigError as exc:
        raise UsageError(f"--allow-host: {exc}") from None
    logging.basicConfig(
        level="INFO",
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    with observing():  # look without writing the epoch: a missing one stays said
        return trio.run(_run, args, t, token, m)


async def _run(args: argparse.Namespace, t: Target, token: str | None, m: ModuleType) -> int:
    password = t.config.password

    def redact(text: str) -> str:
        return text.replace(password, "***") if password else text

    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with mesh.open_client(t.config, namespace=t.namespace) as client:
            async with m.serve_dashboard(
                client,
                port=args.port,
                host=args.host,
                token=token,
                interval=args.interval,
                header={"redis": t.shown, "namespace": t.namespace},
                redact=redact,
                allow_hosts=args.allow_host,
            ) as url:
                log.info(
                    "dashboard of %s namespace %s at %s%s",
                    t.shown,
                    t.namespace,
                    url,
                    " (open it with ?token=TOKEN)" if token else "",
                )
                async for signum in signals:
                    log.info("%s received: stopping", signal.Signals(signum).name)
                    break
    return 0
