"""The worker process: one env, one channel, a plain command loop.

Started by a backend as ``python -m gym_fork.worker FD`` (for CRIU, as PID 1 of its own PID
namespace via ``unshare --pid --fork``).  It becomes a session leader (CRIU needs no
``--shell-job`` then), receives ``("init", source)``, builds the env and serves commands until
``close`` or until the controller goes away (EOF on the channel), so a worker never outlives
its controller.

A CRIU-restored copy of this process wakes up inside :func:`serve`, blocked in ``recv`` on a
fresh channel that CRIU attached in place of the old one, and carries on from there.
"""

from __future__ import annotations

import os
import sys
import traceback

# Single-threaded numerics: smaller images, and fork() stays safe (see ARCHITECTURE.md).
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
os.environ.setdefault("SDL_AUDIODRIVER", "dummy")

from gym_fork.protocol import ERR, OK, Channel, ChannelClosed  # noqa: E402
from gym_fork.server import EnvServer, build_env  # noqa: E402


def _error_reply(exc: BaseException) -> tuple:
    return (ERR, type(exc).__name__, str(exc), traceback.format_exc())


def serve(chan: Channel, server: EnvServer) -> None:
    while True:
        try:
            cmd, args = chan.recv()
        except ChannelClosed:
            return
        if cmd == "close":
            try:
                server.cmd_close()
            finally:
                chan.send((OK, None))
            return
        try:
            reply = (OK, server.dispatch(cmd, args))
        except Exception as exc:  # noqa: BLE001 - every env error goes back to the controller
            reply = _error_reply(exc)
        try:
            chan.send(reply)
        except ChannelClosed:
            return
        except Exception as exc:  # noqa: BLE001 - e.g. the result does not pickle
            chan.send(_error_reply(exc))


def main(argv: list[str]) -> int:
    try:
        os.setsid()
    except OSError:
        pass  # already a session leader
    chan = Channel.from_fd(int(argv[1]))
    try:
        cmd, args = chan.recv()
    except ChannelClosed:
        return 0
    if cmd != "init":
        chan.send((ERR, "ProtocolError", f"expected init, got {cmd!r}", ""))
        return 2
    try:
        server = EnvServer(build_env(args[0]))
        chan.send((OK, server.cmd_meta()))
    except Exception as exc:  # noqa: BLE001
        chan.send(_error_reply(exc))
        return 1
    serve(chan, server)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
