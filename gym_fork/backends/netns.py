"""A network namespace of its own for an env worker (``ForkableEnv(..., private_network=True)``).

Servers an env starts (Redis on ``127.0.0.1:6379``, a web app on port 8000) listen on addresses,
and a restored copy of the env needs the very same addresses while the original still holds them.
With a namespace per worker (only ``lo``, brought up here) every copy has its own: CRIU dumps the
tree's sockets (listening ones and established loopback connections, ``tcp_established``) and
restores them into a *fresh* namespace made here for each restore, passed to CRIU as the external
namespace ``net[INO]``.  Nothing in such a namespace reaches the outside network.

The worker's channel socket must belong to the worker's namespace (CRIU looks sockets up in the
dumped tree's namespace), so every channel that CRIU may dump is created inside it
(:func:`socketpair_in`).  :func:`in_netns` runs any call inside a namespace (the migration client
connects from one with it).

Needs root (``CAP_SYS_ADMIN`` for ``unshare(CLONE_NEWNET)``).

Example (as root):
    >>> ns, (ours, theirs) = new_netns()          # doctest: +SKIP
    >>> os.close(ns); ours.close(); theirs.close()  # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import threading
from typing import Any, Callable

CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` run in a short-lived thread of its own: a thread's network namespace is its
    own, so an ``unshare()`` or ``setns()`` there changes nothing for the rest of this process.

    Returns:
        What ``fn`` returned.

    Raises:
        Whatever ``fn`` raised (re-raised in the caller's thread).
    """
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            out["error"] = e

    t = threading.Thread(target=run, name="gym_fork-netns")
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _join(path: str) -> None:
    """This thread joins the network namespace at ``path``."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc().setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}) failed: {os.strerror(err)}")
    finally:
        os.close(fd)


def netns_path(netns: str) -> str:
    """``/run/netns/NAME`` for a name made by ``ip netns add``; an absolute path as given."""
    return netns if netns.startswith("/") else f"/run/netns/{netns}"


def in_netns(netns: str | None, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` run in the network namespace ``netns`` (a name made by ``ip netns add``, or
    a path such as ``/proc/PID/ns/net``); here when None.  Sockets it creates belong to that
    namespace and stay usable from every thread.

    Returns:
        What ``fn`` returned.

    Raises:
        OSError: the namespace cannot be joined (and whatever ``fn`` raises).
    """
    if not netns:
        return fn(*args)

    def joined() -> Any:
        _join(netns_path(netns))
        return fn(*args)

    return in_thread(joined)


def _lo_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(s, _SIOCGIFFLAGS, ifr))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | _IFF_UP, b""))


def _make() -> tuple[int, tuple[socket.socket, socket.socket]]:
    if _libc().unshare(CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNET) failed: {os.strerror(err)} (a private network needs root)")
    _lo_up()
    pair = socket.socketpair()
    return os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC), pair


def new_netns() -> tuple[int, tuple[socket.socket, socket.socket]]:
    """A fresh network namespace with ``lo`` up: ``(fd of the namespace, socketpair created in it)``.

    The namespace lives while a process is in it or the fd is open.

    Raises:
        OSError: no privilege to create a network namespace.
    """
    return in_thread(_make)


def socketpair_in(pid: int) -> tuple[socket.socket, socket.socket]:
    """A socketpair that belongs to the network namespace of process ``pid``."""
    return in_netns(f"/proc/{pid}/ns/net", socket.socketpair)


def netns_inode(pid: int) -> int:
    """Inode of the network namespace of ``pid`` (what CRIU's external ``net[INO]`` names)."""
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def same_netns_as_us(pid: int) -> bool:
    try:
        return netns_inode(pid) == os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return True
