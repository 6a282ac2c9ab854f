"""``gym-fork agent``: the node agent. It accepts authenticated connections, receives env
workers and whole jobs (:mod:`gym_fork.migration.receive`) and runs them here: an env worker's
channel is relayed over the same TCP connection; a job is supervised so that it can move on."""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
from typing import Any

from gym_fork.errors import AuthenticationError
from gym_fork.migration.receive import JobSite, receive_env, receive_job
from gym_fork.migration.wire.auth import server_handshake
from gym_fork.migration.wire.messages import recv_msg, send_msg
from gym_fork.migration.wire.relay import relay
from gym_fork.snapshots import sessiondir

log = logging.getLogger("gym_fork.agent")
HANDSHAKE_TIMEOUT_S = 10.0


class Agent:
    """Listens on ``host:port``; one thread per connection, each must pass the handshake first.

    Args:
        host, port: where to listen (port 0: any free one; see ``address``).
        state_dir: private directory for received checkpoints (made 0700).
        token: the shared token.
        node: this node's name (default: the hostname).
        cert, key: PEM files; both given: TLS.

    Raises:
        ValueError: no token, or only one of ``cert``/``key``.
    """

    def __init__(self, host: str, port: int, state_dir: str, token: bytes, *, node: str | None = None,
                 cert: str | None = None, key: str | None = None):
        if not token:
            raise ValueError("an agent needs a token")
        self.token = token
        self.node = node or socket.gethostname()
        self.state_dir = sessiondir.private_mkdir(os.path.abspath(state_dir))
        self.jobs = JobSite(self.node, token, self.state_dir, log=log)
        self.tls: ssl.SSLContext | None = None
        if cert or key:
            if not (cert and key):
                raise ValueError("TLS needs both --cert and --key")
            self.tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self.tls.load_cert_chain(cert, key)
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.address = self.sock.getsockname()[:2]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.envs: dict[int, Any] = {}  # pid -> handle of each env worker running here

    # --- lifecycle ------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Accept connections until :meth:`stop`."""
        log.info("agent %s listening on %s:%d (tls=%s, state dir %s)", self.node, *self.address,
                 bool(self.tls), self.state_dir)
        self.sock.settimeout(0.5)
        while not self._stop.is_set():
            try:
                conn, peer = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    break
                raise
            threading.Thread(target=self._connection, args=(conn, peer), daemon=True,
                             name=f"agent-{peer[0]}:{peer[1]}").start()

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
        with self._lock:
            envs = list(self.envs.values())
        for h in envs:
            try:
                h.kill()
            except Exception:  # noqa: BLE001 - best effort, at shutdown
                pass
        self.jobs.kill_all()

    # --- one connection ---------------------------------------------------------------------------
    def _connection(self, conn: socket.socket, peer: tuple) -> None:
        who = f"{peer[0]}:{peer[1]}"
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
            nonce = server_handshake(conn, self.token, self.node)
            req = dict(recv_msg(conn), _session=nonce)  # streamed checkpoints must be signed for it
        except AuthenticationError as e:
            log.warning("REFUSED %s: %s", who, e)
            conn.close()
            return
        except (OSError, EOFError, ValueError, ssl.SSLError) as e:
            log.warning("REFUSED %s: not a gym_fork client or broken handshake (%s: %s)", who, type(e).__name__, e)
            conn.close()
            return
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
        finally:
            try:
                conn.close()
            except OSError:
                pass

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
