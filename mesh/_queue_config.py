"""How a worker serves one queue: the kinds of handler, and
:class:`QueueConfig`, ``start_work``'s options checked once, before anything
starts."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs

from ._balance import check_capacity
from ._errors import ConfigError
from ._keys import check_queue
from ._policy import QueuePolicy, policy_fields
from ._types import Process
from ._validate import seconds_field, whole, whole_field

__all__ = [
    "BatchHandler",
    "Batched",
    "Handler",
    "QueueConfig",
    "check_handler",
    "served_options",
]

Handler = Callable[[Process], Awaitable[Any]]
BatchHandler = Callable[[list[Process]], Awaitable[Sequence[Any] | None]]


def check_handler(handler: object) -> None:
    """Refuse a handler that is not an async callable: an ``async def``
    function or method, a :func:`functools.partial` of one, or an object
    whose ``__call__`` is ``async def``. A plain ``def`` would run its side
    effects, then fail every attempt on ``await`` until dead-lettered.

    Raises:
        TypeError: not callable, or not async; the message says what to do.
    """
    if not callable(handler):
        raise TypeError(
            f"handler must be an async callable taking a Process, not {type(handler).__name__}"
        )
    if _is_async_callable(handler):
        return
    name = getattr(handler, "__qualname__", None) or type(handler).__name__
    raise TypeError(
        f"handler {name} is not async: a handler is 'async def handler(process)', a "
        "functools.partial of one, or an object with 'async def __call__' (a plain def, "
        "or a lambda that returns a coroutine, is refused before any task runs)"
    )


@attrs.frozen
class Batched:
    """A batch handler and its batch size, as a value of the APP mapping of
    ``mesh worker`` (``{"rows": mesh.Batched(write_rows, 100)}``): that queue
    is served with ``start_work(queue, batch_handler=handler, batch=size)``.
    See :meth:`mesh.Worker.start_work` for what a batch handler returns.

    Raises:
        TypeError: ``handler`` is not an async callable, or ``size`` is not
            a whole number >= 1.
    """

    handler: BatchHandler = attrs.field(validator=lambda _i, _a, h: check_handler(h))
    size: int = attrs.field(
        default=10, validator=lambda _i, _a, n: whole("batch size", n, 1, error=TypeError)
    )


def _is_async_callable(obj: object) -> bool:
    while isinstance(obj, functools.partial):
        obj = obj.func
    if inspect.iscoroutinefunction(obj):
        return True
    if inspect.isroutine(obj) or inspect.isclass(obj):
        return False
    return inspect.iscoroutinefunction(getattr(obj, "__call__", None))  # noqa: B004


def _handler(_instance: object, _attribute: object, handler: Any) -> None:
    if handler is not None:
        check_handler(handler)


def _prefetch(_instance: object, _attribute: object, n: int | None) -> None:
    if n is not None:
        whole("prefetch", n)


@attrs.frozen
class QueueConfig:
    """How a worker serves one queue: ``start_work``'s options, checked here.

    Raises:
        ConfigError: on construction, a bad queue name, a value out of
            range (named in the message), ``batch`` above ``concurrency``,
            ``prefetch`` with a batch handler, or ``backoff`` above
            ``backoff_max``.
        TypeError: a queue name that is not a str, a handler that is not an
            async callable.
    """

    queue: str = attrs.field(validator=lambda _i, _a, q: check_queue(q))
    # With batch > 0, a BatchHandler (up to ``batch`` processes per call).
    handler: Handler | BatchHandler | None = attrs.field(validator=_handler)
    concurrency: int = attrs.field(validator=whole_field(1))
    max_attempts: int = attrs.field(validator=whole_field())
    backoff: float = attrs.field(validator=seconds_field())
    backoff_max: float = attrs.field(validator=seconds_field())
    balance: bool = True
    rebalance: bool = True
    # seconds a handler may run (0: no limit)
    timeout: float = attrs.field(default=0.0, validator=seconds_field())
    # seconds results are kept (0: not kept)
    result_ttl: float = attrs.field(default=0.0, validator=seconds_field())
    rate: tuple[int, int] | None = None  # at most (claims, per ms) across the mesh
    # 0: handler(process); n >= 1: handler(up to n processes)
    batch: int = attrs.field(default=0, validator=whole_field())
    # this worker's part of the queue's fair share (see _balance)
    capacity: int = attrs.field(default=1, validator=lambda _i, _a, c: check_capacity(c))
    # Processes claimed beyond ``concurrency``, held here until a slot frees:
    # None (the default) adapts (see RunnerCore.pipeline: about what the
    # slots run in a claim round trip while handlers are short and the queue
    # has a backlog, none otherwise; a batch handler gets none); 0: none;
    # n: always up to n (plain handlers only).
    prefetch: int | None = attrs.field(default=None, validator=_prefetch)

    def __attrs_post_init__(self) -> None:
        if self.batch > self.concurrency:
            raise ConfigError(
                f"batch ({self.batch}) is more than concurrency ({self.concurrency}), the "
                "most processes at once: a batch could never be full"
            )
        if self.prefetch and self.batch:
            raise ConfigError(
                "prefetch is for plain handlers: a batch handler already gets the processes "
                "claimed together (raise batch or concurrency instead)"
            )
        if self.backoff > self.backoff_max:
            raise ConfigError(
                f"need backoff <= backoff_max, got {self.backoff!r}, {self.backoff_max!r}"
            )

    def with_policy(self, p: QueuePolicy) -> QueueConfig:
        """This config under the queue's policy ``p``."""
        return attrs.evolve(
            self,
            max_attempts=p.max_attempts,
            backoff=p.backoff,
            backoff_max=p.backoff_max,
            timeout=p.timeout,
            result_ttl=p.result_ttl,
            rate=(p.rate_limit, round(p.rate_period * 1000)) if p.rate_limit > 0 else None,
        )


def served_options(
    queue: str,
    handler: Handler | None,
    batch_handler: BatchHandler | None,
    concurrency: int | None,
    batch: int,
    retry: dict[str, Any],
    **rest: Any,
) -> tuple[QueueConfig, QueuePolicy, dict[str, Any]]:
    """``start_work``'s arguments (see :meth:`mesh.Worker.start_work`) as a
    :class:`QueueConfig`, the queue's local policy (the retry options given,
    over the defaults) and the retry options given explicitly (to warn when
    the stored policy differs). ``retry`` maps ``max_attempts``, ``backoff``
    and ``backoff_max`` to the values given (None: not given); ``rest`` are
    the other fields of :class:`QueueConfig` (``balance``, ``rebalance``,
    ``capacity``, ``prefetch``). Nothing starts here.

    Raises:
        ConfigError: both a handler and a batch handler, ``batch`` < 1 with a
            batch handler, or anything :class:`QueueConfig` refuses.
        TypeError: as from :class:`QueueConfig`.
    """
    if batch_handler is not None:
        if handler is not None:
            raise ConfigError("give a handler or a batch_handler, not both")
        whole("batch", batch, 1)
    explicit = {k: v for k, v in retry.items() if v is not None}
    # the same checks as Client.configure (ConfigError), on the values
    # given, before the defaults join them: whole numbers, seconds from 0
    # to ten years, backoff <= backoff_max
    policy_fields(**explicit)
    local = attrs.evolve(QueuePolicy(), **explicit)
    cfg = QueueConfig(
        queue,
        handler if batch_handler is None else batch_handler,
        (10 if batch_handler is None else batch) if concurrency is None else concurrency,
        local.max_attempts,
        local.backoff,
        local.backoff_max,
        batch=0 if batch_handler is None else batch,
        **rest,
    )
    return cfg, local, explicit
