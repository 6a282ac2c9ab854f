"""Image files sent while CRIU is still writing them (the request's ``"stream": 3``).

CRIU writes every image file once, front to back, so what has been read of a file is final: the
sender ships (and hashes) each file's bytes as they appear, overlapping dump and transfer. After
the agent's go, frames ``!BIQ`` (kind, file number, length): OPEN (+ the name), DATA (+ bytes),
DONE; then one control message, the signed metadata whose ``images`` are the digests of what
was sent, then the agent's verdict. Each side hashes every byte exactly once, as it sends or
writes it: nothing is read twice and no manifest is written.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import struct
import threading
from typing import Any, Callable

from gym_fork.errors import TransferError
from gym_fork.migration.wire.messages import recv_exact, recv_msg, send_msg
from gym_fork.snapshots.sessiondir import is_image_name

STREAM = 3  # the only stream format; the request says which, so a later one can be told apart
_FRAME = struct.Struct("!BIQ")
_F_OPEN, _F_DATA, _F_DONE = 1, 2, 3
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # always fullmatch: "$" would accept a trailing newline


def stream_hash() -> str:
    """The digest for streamed images: BLAKE3 where installed (several times faster than sha256,
    and both ends hash every byte), else sha256."""
    import importlib.util

    return "blake3" if importlib.util.find_spec("blake3") is not None else "sha256"


def _new_hash(alg: str) -> Any:
    if alg == "blake3":
        import blake3

        return blake3.blake3()
    if alg == "sha256":
        return hashlib.sha256()
    raise TransferError(f"unknown image digest {alg!r} (this node knows sha256 and blake3)")


def transfer_error(target: str, e: BaseException, sent: int, all_sent: bool) -> TransferError:
    """The error of a stream that broke: before everything was sent (nothing is restored there)
    or while waiting for the verdict."""
    if all_sent:
        return TransferError(f"the connection to the agent at {target} broke while waiting for its "
                             f"confirmation ({type(e).__name__}: {e})")
    return TransferError(f"the connection to the agent at {target} broke after {sent} bytes "
                         f"({type(e).__name__}: {e}); nothing was restored there")


class DumpThread:
    """The writing side of :func:`send_images`: ``dump()`` (a CRIU dump into the images
    directory) runs in a thread of its own while the caller streams what it writes.

    Args:
        dump: writes the images; what it returns is kept in ``result``.
        on_end: called in that thread once ``dump`` returned or raised (for timings).
        name: the thread's name.

    Attributes:
        done: set once ``dump`` returned or raised (``send_images``' ``dump_done``).
        failed: set when it raised (``send_images``' ``dump_failed``).
    """

    def __init__(self, dump: Callable[[], Any], *, on_end: Callable[[], None] | None = None,
                 name: str = "gym_fork-dump"):
        self.done, self.failed = threading.Event(), threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(dump, on_end), daemon=True, name=name)
        self._thread.start()

    def _run(self, dump: Callable[[], Any], on_end: Callable[[], None] | None) -> None:
        try:
            self.result = dump()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread (raise_error)
            self.error = e
            self.failed.set()
        finally:
            if on_end is not None:
                on_end()
            self.done.set()

    def raise_error(self) -> None:
        """Raise the dump's own error, if it failed (the stream's ValueError only echoes it)."""
        if self.error is not None:
            raise self.error from None

    def join(self) -> None:
        self._thread.join()


def send_images(sock: socket.socket, header: dict, images: str, target: str,
                trailer: Callable[[dict], dict], dump_done: threading.Event, dump_failed: threading.Event,
                limit: int, alg: str | None = None) -> tuple[dict, int]:
    """Stream the image files of ``images`` while a CRIU dump into it may still run.

    Args:
        sock: an authenticated connection.
        header: the request (``op`` and what it needs); ``stream``, ``size`` and ``hash`` are added.
        images: the directory CRIU dumps into.
        target: the peer's address, for messages.
        trailer: ``trailer(digests) -> metadata``: the signed metadata sent after the images.
        dump_done: set when the dump returned; ``dump_failed`` also set when it failed.
        limit: the most bytes this may send (announced: the agent checks its disk space).
        alg: the digest (default :func:`stream_hash`).

    Returns:
        ``(reply, bytes sent)``: the agent's verdict (or its refusal before the stream).

    Raises:
        TransferError: the connection broke.
        ValueError: the dump failed, or the images outgrew ``limit`` or changed after they were
            sent (the caller closes ``sock``: the agent drops what it got).
    """
    files: dict[str, list] = {}  # name -> [fd, offset, hash, number]
    sent = 0
    buf = memoryview(bytearray(1 << 20))
    alg = alg or stream_hash()
    all_sent = False
    try:
        send_msg(sock, dict(header, size=limit, stream=STREAM, hash=alg))
        go = recv_msg(sock)
        if not go.get("ok"):
            return go, 0
        while True:
            last = dump_done.is_set()  # read before the pass: a pass after the dump sees everything
            if dump_failed.is_set():
                raise ValueError("the CRIU dump failed")
            progressed = False
            try:
                names = sorted(os.listdir(images))
            except FileNotFoundError:  # not made yet (or removed by a failed dump: checked next pass)
                names = []
            for name in names:
                ent = files.get(name)
                if ent is None:
                    if not is_image_name(name) or not _SAFE_NAME.fullmatch(name):
                        continue
                    try:
                        fd = os.open(os.path.join(images, name), os.O_RDONLY | os.O_NOFOLLOW)
                    except (FileNotFoundError, IsADirectoryError):
                        continue
                    ent = files[name] = [fd, 0, _new_hash(alg), len(files)]
                    raw = name.encode()
                    sock.sendall(_FRAME.pack(_F_OPEN, ent[3], len(raw)) + raw)
                while True:
                    k = os.preadv(ent[0], [buf], ent[1])
                    if not k:
                        break
                    if sent + k > limit:
                        raise ValueError(f"the images outgrew the announced {limit} bytes")
                    ent[2].update(buf[:k])  # what is hashed is exactly what is sent
                    sock.sendall(_FRAME.pack(_F_DATA, ent[3], k))
                    sock.sendall(buf[:k])
                    ent[1] += k
                    sent += k
                    progressed = True
            if last:
                break
            if not progressed:
                dump_done.wait(0.002)
        for name, ent in files.items():  # write-once files: nothing may have vanished or shrunk
            if os.fstat(ent[0]).st_size != ent[1] or not os.path.exists(os.path.join(images, name)):
                raise ValueError(f"image {name} changed after it was sent")
        sock.sendall(_FRAME.pack(_F_DONE, 0, 0))
        digests = {name: {"size": ent[1], alg: ent[2].hexdigest()} for name, ent in files.items()}
        send_msg(sock, trailer(digests))
        all_sent = True
        return recv_msg(sock), sent
    except (OSError, EOFError) as e:
        raise transfer_error(target, e, sent, all_sent) from e
    finally:
        for ent in files.values():
            os.close(ent[0])


def receive_images(sock: socket.socket, limit: int, dest: str, alg: str) -> tuple[dict, int]:
    """The receiving end of :func:`send_images`: the files land in ``dest`` (mode 0600, plain
    names only), each hashed as it is written.

    Args:
        limit: the announced size; a stream that outgrows it is refused.
        alg: the request's ``hash``.

    Returns:
        ``(digests, bytes)``: ``digests[name] = {"size", alg}``, to compare with the signed list.

    Raises:
        EOFError: the stream was cut.
        TransferError: a malformed stream, a refused name, or more than ``limit`` bytes.
    """
    fds: list[int] = []
    names: list[str] = []
    hashes: list[Any] = []
    sizes: list[int] = []
    total = 0
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    try:
        while True:
            kind, num, n = _FRAME.unpack(recv_exact(sock, _FRAME.size))
            if kind == _F_DONE:
                break
            if kind == _F_OPEN:
                if num != len(fds) or n > 255:
                    raise TransferError(f"bad OPEN frame (file {num}, name length {n})")
                name = recv_exact(sock, n).decode("utf-8", "strict")
                if not _SAFE_NAME.fullmatch(name) or name in (".", "..") or name in names:
                    raise TransferError(f"refusing image name {name!r}")
                h = _new_hash(alg)
                fds.append(os.open(os.path.join(dest, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
                names.append(name)
                hashes.append(h)
                sizes.append(0)
            elif kind == _F_DATA:
                if num >= len(fds):
                    raise TransferError(f"DATA frame for unknown file {num}")
                if total + n > limit:
                    raise TransferError(f"the images outgrow the announced {limit} bytes")
                total += n
                sizes[num] += n
                while n:
                    k = sock.recv_into(view[: min(len(buf), n)])
                    if k == 0:
                        raise EOFError(f"transfer cut after {total - n} bytes")
                    chunk = view[:k]
                    hashes[num].update(chunk)  # what is hashed is exactly what is written
                    while chunk:
                        chunk = chunk[os.write(fds[num], chunk):]
                    n -= k
            else:
                raise TransferError(f"unknown frame kind {kind}")
    except UnicodeDecodeError as e:
        raise TransferError(f"refusing an image name that is not UTF-8: {e}") from e
    finally:
        for fd in fds:
            os.close(fd)
    return {name: {"size": size, alg: h.hexdigest()} for name, h, size in zip(names, hashes, sizes)}, total
