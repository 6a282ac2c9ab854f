"""``gym-fork agent``: the node agent. It accepts authenticated connections, receives env
workers and whole jobs (:mod:`gym_fork.migration.receive`) and runs them here: an env worker's
channel is relayed over the same (TLS) connection; a job is supervised so that it can move on.

An agent on a network stays up under load and under abuse: the TLS + token handshake of each
connection must be over within one deadline (however the peer paces its bytes), connections
and unauthenticated ones are capped separately (the caps derive from the fd limit unless set),
and when the process runs out of file descriptors or threads it refuses new connections, logs
it and backs off -- what it already hosts keeps running.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import socket
import threading
import time
from typing import Any

from gym_fork.errors import AuthenticationError
from gym_fork.migration.receive import JobSite, receive_env, receive_job
from gym_fork.migration.targets import TargetContext
from gym_fork.migration.wire.accept import HANDSHAKE_TIMEOUT_S, accept
from gym_fork.migration.wire.messages import recv_msg, send_msg
from gym_fork.migration.wire.relay import relay
from gym_fork.migration.wire.tls import server_tls
from gym_fork.snapshots import sessiondir

log = logging.getLogger("gym_fork.agent")
MAX_CONNECTIONS = 256
MAX_UNAUTHENTICATED = 32
FDS_PER_CONNECTION = 3  # the socket, a hosted worker's channel, one in use while restoring
FDS_RESERVED = 64  # the agent's own, CRIU's while restoring
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def default_limits() -> tuple[int, int]:
    """``(max connections, max unauthenticated)`` that fit this process's fd limit."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    fit = MAX_CONNECTIONS if soft == resource.RLIM_INFINITY else (soft - FDS_RESERVED) // FDS_PER_CONNECTION
    conns = max(4, min(MAX_CONNECTIONS, fit))
    return conns, max(2, min(MAX_UNAUTHENTICATED, conns // 2))


class _Throttled:
    """Logs a recurring warning at most once a second, with how many were not logged between
    (so that a flood of refused connections cannot fill the disk with log lines)."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}
        self._lock = threading.Lock()

    def warning(self, kind: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(kind, -1e9) < 1.0:
                self._skipped[kind] = self._skipped.get(kind, 0) + 1
                return
            skipped = self._skipped.pop(kind, 0)
            self._last[kind] = now
        log.warning(msg + (f" ({skipped} more like it since the last report)" if skipped else ""), *args)


class Agent:
    """Listens on ``host:port``; one thread per connection, each must pass the handshake first.

    Args:
        host, port: where to listen (port 0: any free one; see ``address``).
        state_dir: private directory for received checkpoints (made 0700).
        token: the shared token.
        node: this node's name (default: the hostname).
        cert, key: PEM files of the TLS certificate; default: one made now (``fingerprint``).
        insecure: plain TCP instead of TLS (see ``gym-fork agent --help`` for what it gives up).
        max_connections: connections open at once, hosted env workers' included (default: what
            the fd limit allows, at most :data:`MAX_CONNECTIONS`); more are closed at once.
        max_unauthenticated: connections still in their handshake (default: half of
            ``max_connections``, at most :data:`MAX_UNAUTHENTICATED`).
        handshake_timeout: seconds for a connection's whole TLS + token handshake and request.

    Raises:
        ValueError: no token, only one of ``cert``/``key``, or ``insecure`` with a certificate.
    """

    def __init__(self, host: str, port: int, state_dir: str, token: bytes, *, node: str | None = None,
                 cert: str | None = None, key: str | None = None, insecure: bool = False,
                 max_connections: int | None = None, max_unauthenticated: int | None = None,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT_S):
        if not token:
            raise ValueError("an agent needs a token")
        if insecure and (cert or key):
            raise ValueError("--insecure is plain TCP: it cannot be combined with --cert/--key")
        self.token = token
        self.node = node or socket.gethostname()
        self.state_dir = sessiondir.private_mkdir(os.path.abspath(state_dir))
        # jobs received here move on the way they came: over TLS, or plain TCP from an --insecure agent
        self.jobs = JobSite(self.node, token, self.state_dir, log=log,
                            targets=TargetContext(token=token, insecure=insecure))
        self.tls = None if insecure else server_tls(cert, key, name=f"gym-fork agent {self.node}")
        conns, unauth = default_limits()
        # None is "the default"; 0 is refused below, not silently read as the default
        self.max_connections = conns if max_connections is None else max_connections
        self.max_unauthenticated = min(unauth if max_unauthenticated is None else max_unauthenticated,
                                       self.max_connections)
        if self.max_connections < 1 or self.max_unauthenticated < 1 or not handshake_timeout > 0:
            raise ValueError("connection limits must be at least 1 and the handshake timeout positive")
        self.handshake_timeout = handshake_timeout
        self.sock = socket.create_server((host, port), reuse_port=False, backlog=128)
        self.address = self.sock.getsockname()[:2]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._open = 0  # connections with a thread
        self._unauth = 0  # of which still in their handshake
        self._warn = _Throttled()
        self._reserve: int | None = self._reserve_fd()
        self.envs: dict[int, Any] = {}  # pid -> handle of each env worker running here

    @property
    def fingerprint(self) -> str | None:
        """The sha256 of the TLS certificate (None: ``insecure``)."""
        return self.tls.fingerprint if self.tls else None

    # --- lifecycle ------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Accept connections until :meth:`stop`. Running out of fds or threads does not end it."""
        log.info("agent %s listening on %s:%d (%s, state dir %s; at most %d connections, %d in their "
                 "handshake, handshake %.0f s)", self.node, *self.address,
                 f"TLS, certificate sha256 {self.fingerprint}" if self.tls else "INSECURE plain TCP",
                 self.state_dir, self.max_connections, self.max_unauthenticated, self.handshake_timeout)
        self.sock.settimeout(0.5)
        backoff = 0.0
        while not self._stop.is_set():
            try:
                conn, peer = self.sock.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._stop.is_set():
                    break
                backoff = min(1.0, max(0.01, backoff * 2))
                self._accept_failed(e, backoff)
                continue
            if self._admit(conn, peer):
                backoff = 0.0
            else:
                backoff = min(1.0, max(0.01, backoff * 2))
                self._stop.wait(backoff)

    def stop(self) -> None:
        """Make :meth:`serve_forever` return (safe from a signal handler)."""
        self._stop.set()

    def shutdown(self) -> None:
        """Stop listening and stop everything running here."""
        self._stop.set()
        try:
            self.sock.close()
        except OSError:
            pass
        if self._reserve is not None:
            os.close(self._reserve)
            self._reserve = None
        with self._lock:
            envs = list(self.envs.values())
        for h in envs:
            try:
                h.kill()
            except Exception:  # noqa: BLE001 - best effort, at shutdown
                pass
        self.jobs.kill_all()

    # --- admission ------------------------------------------------------------------------------
    @staticmethod
    def _reserve_fd() -> int | None:
        try:
            return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None

    def _accept_failed(self, e: OSError, backoff: float) -> None:
        """``accept`` failed: out of fds (or memory) -- free the reserve fd to accept and close
        the oldest waiting connection (so peers are told at once instead of hanging in the
        backlog), take the reserve back, and wait ``backoff``; anything else: log and go on."""
        if e.errno in _OUT_OF_RESOURCES:
            self._warn.warning("accept", "shedding load: cannot accept a connection (%s); what runs here "
                               "keeps running; retrying in %.2f s", e, backoff)
            if self._reserve is not None:
                os.close(self._reserve)
                self._reserve = None
                try:
                    self.sock.settimeout(0)
                    self.sock.accept()[0].close()
                except OSError:
                    pass
                finally:
                    self.sock.settimeout(0.5)
                self._reserve = self._reserve_fd()
        else:
            self._warn.warning("accept-other", "accept failed: %s; retrying in %.2f s", e, backoff)
        self._stop.wait(backoff)
        if self._reserve is None:
            self._reserve = self._reserve_fd()

    def _admit(self, conn: socket.socket, peer: tuple) -> bool:
        """Start a thread for ``conn`` if the limits allow, else close it. Returns False when
        the process could not start a thread (the caller backs off)."""
        with self._lock:
            full = self._open >= self.max_connections or self._unauth >= self.max_unauthenticated
            if not full:
                self._open += 1
                self._unauth += 1
            counts = (self._open, self._unauth)
        if full:
            conn.close()
            self._warn.warning("limit", "shedding load: refused a connection from %s (%d open of %d, %d in "
                               "their handshake of %d)", peer[0], counts[0], self.max_connections,
                               counts[1], self.max_unauthenticated)
            return True
        try:
            threading.Thread(target=self._connection, args=(conn, peer), daemon=True,
                             name=f"agent-{peer[0]}:{peer[1]}").start()
        except RuntimeError as e:  # "can't start new thread": out of tasks or memory
            with self._lock:
                self._open -= 1
                self._unauth -= 1
            conn.close()
            self._warn.warning("thread", "shedding load: cannot start a thread for a connection (%s); what "
                               "runs here keeps running", e)
            return False
        return True

    # --- one connection ---------------------------------------------------------------------------
    def _connection(self, conn: socket.socket, peer: tuple) -> None:
        who = f"{peer[0]}:{peer[1]}"
        authenticated = False
        try:
            deadline = time.monotonic() + self.handshake_timeout
            try:
                conn, nonce = accept(conn, self.token, self.node, self.tls, deadline=deadline)
                with self._lock:
                    self._unauth -= 1
                authenticated = True
                req = dict(recv_msg(conn, deadline=deadline), _session=nonce)  # checkpoints must be signed for it
                conn.settimeout(self.handshake_timeout)  # the op sets its own from here
            except AuthenticationError as e:
                self._warn.warning("refused", "REFUSED %s: %s", who, e)
                return
            except Exception as e:  # noqa: BLE001 - garbage, a broken handshake or time up: never fatal
                self._warn.warning("refused", "REFUSED %s: not a gym_fork client or broken handshake (%s: %s)",
                                   who, type(e).__name__, e)
                return
            self._serve(conn, req, who)
        finally:
            try:
                conn.close()
            except OSError:
                pass
            with self._lock:
                self._open -= 1
                if not authenticated:
                    self._unauth -= 1

    def _serve(self, conn: socket.socket, req: dict, who: str) -> None:
        op = req.get("op")
        log.info("%s authenticated: op=%s size=%s", who, op, req.get("size"))
        try:
            if op == "ping":
                send_msg(conn, {"ok": True, "node": self.node, "pid": os.getpid()})
            elif op == "env":
                self._op_env(conn, req, who)
            elif op == "job":
                receive_job(self.jobs, conn, req, who)
            else:
                log.warning("REFUSED %s: unknown op %r", who, op)
                send_msg(conn, {"ok": False, "error": "ValueError", "message": f"unknown op {op!r}"})
        except Exception as e:  # noqa: BLE001 - log everything, keep serving
            log.exception("%s: op %s failed: %s", who, op, e)

    def _op_env(self, conn: socket.socket, req: dict, who: str) -> None:
        """Receive and restore one env worker, then relay its channel until either side closes."""
        try:
            handle, timings = receive_env(conn, req, self.state_dir, self.node, self.jobs.key)
        except EOFError as e:
            log.warning("%s: %s; nothing restored", who, e)
            return
        except Exception as e:  # noqa: BLE001 - the sender is told why
            log.warning("%s: env checkpoint refused/failed: %s: %s", who, type(e).__name__, e)
            try:
                send_msg(conn, {"ok": False, "error": type(e).__name__, "message": str(e)})
            except OSError:
                pass
            return
        with self._lock:
            self.envs[handle.pid] = handle
        try:
            send_msg(conn, {"ok": True, "node": self.node, "pid": handle.pid, "timings": timings})
            log.info("%s: env worker restored as pid %d; relaying its channel", who, handle.pid)
            conn.settimeout(None)
            relay(conn, handle.chan.sock)
        except OSError:
            pass
        finally:
            handle.kill()
            with self._lock:
                self.envs.pop(handle.pid, None)
            log.info("%s: connection closed; env worker %d stopped", who, handle.pid)
