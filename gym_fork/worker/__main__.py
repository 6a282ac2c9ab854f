"""Start an env worker: ``python -m gym_fork.worker FD``.

A backend starts every worker this way (:mod:`gym_fork.backends.criu`).  The worker's stdout
and stderr go to ``/dev/null`` unless the env was given a ``worker_log``: a file or a pipe there
would have to be captured by every CRIU image of the worker.  So a worker that fails before its
command loop runs -- an import that fails in this interpreter, a broken install -- could only
exit, and the learner would read "exited with code 1" and nothing else.  This module imports
only the standard library before it imports the worker's loop; when that import fails it still
reads the controller's ``init`` request and answers it with the error and its traceback, in the
channel's own framing (:mod:`gym_fork.worker.channel`), so the learner raises a
:class:`~gym_fork.errors.WorkerError` that says what went wrong.
"""

from __future__ import annotations

import pickle
import socket
import struct
import sys
import traceback

_HEADER = struct.Struct("!Q")  # gym_fork.worker.channel's frame header: the payload's length
_FLAGS = 1 << 63  # its packed-frame flag (never set on an init request)
ERR = 1  # gym_fork.worker.channel.ERR
#: how long a worker that could not start waits for the ``init`` request it answers
INIT_WAIT_S = 30.0


def answer_init_with_error(fd: int, type_name: str, message: str, tb: str) -> None:
    """Read the controller's next request on the channel ``fd`` (its ``init``) and answer it
    with ``(ERR, type_name, message, tb)``.  Gives up quietly when the controller is gone."""
    sock = socket.socket(fileno=fd)
    try:
        sock.settimeout(INIT_WAIT_S)
        head = _read_exactly(sock, _HEADER.size)
        if head is None:
            return
        _read_exactly(sock, _HEADER.unpack(head)[0] & ~_FLAGS)
        payload = pickle.dumps((ERR, type_name, message, tb), protocol=pickle.HIGHEST_PROTOCOL)
        sock.sendall(_HEADER.pack(len(payload)) + payload)
    except OSError:
        pass  # the controller went away: it reports the exit status instead
    finally:
        sock.detach()  # the fd is the caller's


def _read_exactly(sock: socket.socket, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def main(argv: list[str]) -> int:
    try:
        from gym_fork.worker import loop
    except BaseException as exc:  # noqa: BLE001 - whatever it was, the learner must hear of it
        message = (f"it could not start, importing gym_fork.worker.loop failed: {exc}. The worker runs "
                   f"{sys.executable} with the learner's sys.path; check that this interpreter imports "
                   "gym_fork and its dependencies (the worker's traceback is in this error's remote_traceback)")
        answer_init_with_error(int(argv[1]), type(exc).__name__, message, traceback.format_exc())
        return 1
    return loop.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
