"""The readable cause of a Ray exception (Ray wraps the remote error; its text is a traceback)."""

from __future__ import annotations


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s text, or its type's name."""
    s = str(e).strip().splitlines()
    return s[0] if s else type(e).__name__


def cause(e: BaseException) -> str:
    """``"Type: message"`` of the error a Ray exception wraps (else its first line)."""
    c = getattr(e, "cause", None)
    if c is not None:
        return f"{type(c).__name__}: {c}"
    return first_line(e)


def cause_type(e: BaseException) -> str:
    """The type name of the error a Ray exception wraps (else of ``e``)."""
    c = getattr(e, "cause", None)
    return type(c).__name__ if c is not None else type(e).__name__
