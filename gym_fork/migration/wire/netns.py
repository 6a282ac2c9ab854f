"""Sockets in another network namespace: ``setns`` affects only the calling thread, so the
socket is made in a short-lived thread that joined the namespace."""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any, Callable

CLONE_NEWNET = 0x40000000


def _setns(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"setns({path}): {os.strerror(e)}")
    finally:
        os.close(fd)


def netns_path(netns: str) -> str:
    """``/run/netns/NAME`` for a name made by ``ip netns add``; an absolute path as given."""
    return netns if netns.startswith("/") else f"/run/netns/{netns}"


def in_netns(netns: str | None, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, run in network namespace ``netns`` (here when None); re-raises its error.

    Raises:
        OSError: the namespace cannot be joined (and whatever ``fn`` raises).
    """
    if not netns:
        return fn(*args)
    box: dict = {}

    def run() -> None:
        try:
            _setns(netns_path(netns))
            box["v"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["e"] = e

    t = threading.Thread(target=run, name="gym_fork-netns")
    t.start()
    t.join()
    if "e" in box:
        raise box["e"]
    return box["v"]
