"""The one check that the caller runs under trio, made where the public
context managers are entered, so that a call from asyncio (or from no event
loop) fails with a sentence that names trio, not with trio's own
"must be called from async context" from deep inside."""

from __future__ import annotations

import sniffio

from ._errors import ConfigError

__all__ = ["require_trio"]


def require_trio(what: str) -> None:
    """Return if the caller runs in a trio task.

    Raises:
        ConfigError: another async library (asyncio) or none runs the caller;
            the message names ``what``, trio, and the docs section on
            asyncio programs.
    """
    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        library = None
    if library == "trio":
        return
    under = f"under {library}" if library else "outside any event loop"
    raise ConfigError(
        f"{what} needs trio and was called {under}: trio-mesh is written for trio "
        "(run it with trio.run). From an asyncio program, run trio in a thread of its "
        "own: see 'Using the mesh from an asyncio program' in docs/concepts.md"
    )
