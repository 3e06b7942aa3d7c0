"""Payloads shown as text on the page, from their first bytes only."""

from __future__ import annotations

from .._view import show_payload

__all__ = ["shown"]


def shown(head: bytes, size: int, width: int = 80) -> str:
    """``head`` (the first bytes of a payload of ``size`` bytes) as
    :func:`~mesh._view.show_payload` shows it, cut to ``width`` characters;
    a payload longer than its head ends in ``…``. A UTF-8 character cut by
    the end of the head is left out. Sync, no I/O."""
    head = head[: width * 4 + 4]
    if len(head) >= size:
        return show_payload(head, width)
    for cut in range(4):
        part = head[: len(head) - cut] if cut else head
        try:
            part.decode()
        except UnicodeDecodeError:
            continue
        head = part
        break
    text = show_payload(head, width)
    return text if text.endswith("…") else text + "…"
