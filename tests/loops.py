"""Behaviour tests on both event loops: a pytest plugin (loaded by conftest.py).

A test module marked ``pytestmark = pytest.mark.both_loops`` runs each of its
async tests twice, ``[trio]`` and ``[asyncio]``. The trio run is pytest-trio's,
exactly as before. The asyncio run is this plugin's: the test's async fixtures
are set up and torn down in the same ``asyncio.run`` as the test (their
dependencies first, teardown in reverse order), and the test body is the same
coroutine function. A test body written with anyio (``anyio.sleep``,
``anyio.create_task_group``, ...) and the public API runs unchanged on both.

``MESH_TEST_ASYNCIO=uvloop`` runs the asyncio variant on uvloop instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from mesh._loop import LOOPS


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "both_loops: run each async test of the module on trio and on asyncio"
    )
    config.addinivalue_line(
        "markers",
        "trio_only(why): in a both_loops module, a test of trio's own machinery "
        "(its scheduler, instruments or mock clock): it runs on trio only",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.definition.get_closest_marker("both_loops") is None:
        return
    if not inspect.iscoroutinefunction(metafunc.function):
        return
    if metafunc.definition.get_closest_marker("trio_only") is not None:
        return
    if "mesh_loop" not in metafunc.fixturenames:
        metafunc.fixturenames.append("mesh_loop")
    metafunc.parametrize("mesh_loop", LOOPS)


def loop_of(node: pytest.Item | pytest.Collector) -> str:
    """The loop a collected test runs on ("trio" unless parametrized here)."""
    callspec = getattr(node, "callspec", None)
    if callspec is None:
        return "trio"
    return str(callspec.params.get("mesh_loop", "trio"))


@pytest.fixture
def mesh_loop(request: pytest.FixtureRequest) -> str:
    """The event loop this test runs on: "trio" or "asyncio"."""
    return str(getattr(request, "param", "trio"))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # pytest-trio marked every async test "trio"; the asyncio runs are ours.
    for item in items:
        if loop_of(item) == "asyncio":
            item.own_markers[:] = [m for m in item.own_markers if m.name != "trio"]


class _AsyncFixture:
    """An async fixture of an asyncio test, set up inside its asyncio.run."""

    def __init__(self, func: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        self.func = func
        self.kwargs = kwargs


@pytest.hookimpl(tryfirst=True)
def pytest_fixture_setup(fixturedef: Any, request: pytest.FixtureRequest) -> object | None:
    if loop_of(request.node) != "asyncio":
        return None
    func = fixturedef.func
    if not (inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func)):
        return None
    kwargs = {name: request.getfixturevalue(name) for name in fixturedef.argnames}
    fixture = _AsyncFixture(func, kwargs)
    fixturedef.cached_result = (fixture, getattr(request, "param_index", 0), None)
    return fixture


def _runner() -> Callable[[Coroutine[Any, Any, None]], None]:
    if os.environ.get("MESH_TEST_ASYNCIO") == "uvloop":
        import uvloop

        return uvloop.run
    return asyncio.run


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if loop_of(pyfuncitem) != "asyncio":
        return None
    names = pyfuncitem._fixtureinfo.argnames
    funcargs = {name: pyfuncitem.funcargs[name] for name in names}

    async def main() -> None:
        done: dict[int, Any] = {}
        async with contextlib.AsyncExitStack() as stack:

            async def resolve(value: Any) -> Any:
                if not isinstance(value, _AsyncFixture):
                    return value
                if id(value) in done:
                    return done[id(value)]
                kwargs = {k: await resolve(v) for k, v in value.kwargs.items()}
                if inspect.isasyncgenfunction(value.func):
                    cm = contextlib.asynccontextmanager(value.func)(**kwargs)
                    result = await stack.enter_async_context(cm)
                else:
                    result = await value.func(**kwargs)
                done[id(value)] = result
                return result

            resolved = {k: await resolve(v) for k, v in funcargs.items()}
            await pyfuncitem.obj(**resolved)

    _runner()(main())
    return True
