"""Reading what a request to the dashboard's API asks for, and saying in one
plain line what was wrong with it (never a Python message such as
``'task'`` or ``invalid literal for int()``)."""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Mapping
from typing import Any

from starlette.requests import Request

from .._errors import ConfigError
from .._keys import check_group, check_queue

__all__ = [
    "BadRequest",
    "b64_field",
    "group_field",
    "int_param",
    "json_body",
    "queue_field",
    "text_field",
]


class BadRequest(Exception):
    """What was wrong with a request, as one line for its 400 answer."""


async def json_body(request: Request, example: str) -> dict[str, Any]:
    """The request's body, a JSON object.

    Raises:
        BadRequest: not JSON, or not an object (``example`` shows one).
    """
    raw = await request.body()
    try:
        body = json.loads(raw) if raw else None
    except (ValueError, UnicodeDecodeError):
        raise BadRequest(f"the body is not JSON: send an object like {example}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object like {example}")
    return body


def text_field(body: Mapping[str, Any], name: str) -> str:
    """``body[name]``, a string.

    Raises:
        BadRequest: missing, or not a string.
    """
    if name not in body:
        raise BadRequest(f"missing {name!r}")
    value = body[name]
    if not isinstance(value, str):
        raise BadRequest(f"{name!r} must be a string, got {type(value).__name__}")
    return value


def _name_field(body: Mapping[str, Any], name: str, check: Callable[[object], str]) -> str:
    """``body[name]``, a name that ``check`` accepts (its ConfigError as a
    BadRequest)."""
    try:
        return check(text_field(body, name))
    except ConfigError as exc:
        raise BadRequest(str(exc)) from None


def queue_field(body: Mapping[str, Any]) -> str:
    """``body["queue"]``, a valid queue name.

    Raises:
        BadRequest: missing, not a string, or not a queue name.
    """
    return _name_field(body, "queue", check_queue)


def group_field(body: Mapping[str, Any]) -> str:
    """``body["group"]``, a valid group name.

    Raises:
        BadRequest: missing, not a string, or not a group name.
    """
    return _name_field(body, "group", check_group)


def b64_field(body: Mapping[str, Any], name: str) -> bytes:
    """``body[name]`` decoded from base64.

    Raises:
        BadRequest: missing, not a string, or not base64.
    """
    text = text_field(body, name)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{name!r} is not base64") from None


def int_param(params: Mapping[str, str], name: str, default: int) -> int:
    """The query parameter ``name`` as a whole number (``default`` when absent).

    Raises:
        BadRequest: not a whole number.
    """
    text = params.get(name)
    if text is None or text == "":
        return default
    if not text.strip().lstrip("-").isdigit() or len(text) > 18:
        raise BadRequest(f"{name} must be a whole number, got {text[:40]!r}")
    return int(text)
