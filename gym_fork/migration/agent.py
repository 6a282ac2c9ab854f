"""``gym-fork agent``: the node agent that receives checkpoints over TCP and restores them.

One thread per connection.  Every connection must pass the challenge-response handshake
(:mod:`gym_fork.migration.wire`) first; anything else is refused and logged.  A checkpoint
arrives as a tar of a bundle; it is unpacked into a private directory under the state dir and
checked (HMAC over bundle.json with the token-derived key, every image's sha256, CRIU/machine/
mapped-file compatibility) *before* anything is restored.  Then:

* ``op="env"`` (one env worker): the worker is restored as the agent's child; the agent answers
  ``ok`` and from then on relays bytes between the TCP connection and the worker's unix channel
  (the learner keeps speaking the ordinary worker protocol).  When either side closes, the
  worker is stopped.  Relay rather than handing the TCP socket to the worker: the worker keeps
  its unix-socket invariants (CRIU external ``unix[INO]``), and TLS stays in one place.
* ``op="job"`` (a whole training job): see :mod:`gym_fork.migration.job`.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import socket
import ssl
import tarfile
import threading
import time
from typing import Any

from gym_fork.snapshots import sessiondir
from gym_fork.migration import wire
from gym_fork.errors import AuthenticationError, NoSpaceError

log = logging.getLogger("gym_fork.agent")
HANDSHAKE_TIMEOUT_S = 10.0
RECEIVE_TIMEOUT_S = 60.0


class Agent:
    def __init__(self, host: str, port: int, state_dir: str, token: bytes, *, node: str | None = None,
                 cert: str | None = None, key: str | None = None):
        if not token:
            raise ValueError("an agent needs a token")
        self.token = token
        self.key = wire.bundle_key(token)
        self.node = node or socket.gethostname()
        self.state_dir = sessiondir.private_mkdir(os.path.abspath(state_dir))
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
        self.hosted: dict[int, Any] = {}  # pid -> handle / job of what runs here now

    # --- lifecycle ------------------------------------------------------------------------------
    def serve_forever(self) -> None:
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

    def shutdown(self) -> None:
        self._stop.set()
        try:
            self.sock.close()
        except OSError:
            pass
        with self._lock:
            hosted = list(self.hosted.values())
        for h in hosted:
            try:
                h.kill()
            except Exception:  # noqa: BLE001
                pass

    # --- one connection ---------------------------------------------------------------------------
    def _connection(self, conn: socket.socket, peer: tuple) -> None:
        who = f"{peer[0]}:{peer[1]}"
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
            nonce = wire.server_handshake(conn, self.token, self.node)
            req = dict(wire.recv_msg(conn), _session=nonce)  # streamed bundles must be signed for it
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
                wire.send_msg(conn, {"ok": True, "node": self.node, "pid": os.getpid()})
            elif op == "env":
                self._op_env(conn, req, who)
            elif op == "job":
                from gym_fork.migration.job import agent_receive_job

                agent_receive_job(self, conn, req, who)
            else:
                log.warning("REFUSED %s: unknown op %r", who, op)
                wire.send_msg(conn, {"ok": False, "error": "ValueError", "message": f"unknown op {op!r}"})
        except Exception as e:  # noqa: BLE001 - log everything, keep serving
            log.exception("%s: op %s failed: %s", who, op, e)
        finally:
            try:
                conn.close()
            except OSError:
                pass

    def receive_bundle(self, conn: socket.socket, req: dict, who: str) -> tuple[str, dict, dict | None]:
        """:func:`receive_checkpoint` into this agent's state dir."""
        return receive_checkpoint(conn, req, self.state_dir, self.node)

    def _op_env(self, conn: socket.socket, req: dict, who: str) -> None:
        from gym_fork.snapshots.bundle import load_snapshot

        d = None
        handle = None
        try:
            d, timings, streamed = self.receive_bundle(conn, req, who)
            t0 = time.monotonic()
            path = os.path.join(d, "bundle")
            if streamed is None:
                snap = load_snapshot(path, key=self.key)  # HMAC, compat, sha256 (re-read)
            else:  # HMAC, session, compat, and the sha256s computed on receipt
                with open(os.path.join(path, "bundle.json"), "w") as f:
                    json.dump(streamed["meta"], f)
                snap = load_snapshot(path, key=self.key, received=streamed["digests"], session=req["_session"])
            timings["verify_s"] = time.monotonic() - t0
            t0 = time.monotonic()
            handle = snap._backend._restore_verified(snap.payload())
            timings["restore_s"] = time.monotonic() - t0
        except EOFError as e:
            log.warning("%s: %s; nothing restored", who, e)
            if d:
                shutil.rmtree(d, ignore_errors=True)
            return
        except Exception as e:  # noqa: BLE001
            log.warning("%s: env checkpoint refused/failed: %s: %s", who, type(e).__name__, e)
            if d:
                shutil.rmtree(d, ignore_errors=True)
            try:
                wire.send_msg(conn, {"ok": False, "error": type(e).__name__, "message": str(e)})
            except OSError:
                pass
            return
        shutil.rmtree(d, ignore_errors=True)  # restored: the images are no longer needed
        with self._lock:
            self.hosted[handle.pid] = handle
        try:
            wire.send_msg(conn, {"ok": True, "node": self.node, "pid": handle.pid, "timings": timings})
            log.info("%s: env worker restored as pid %d; relaying its channel", who, handle.pid)
            conn.settimeout(None)
            relay(conn, handle.chan.sock)
        except OSError:
            pass
        finally:
            handle.kill()
            with self._lock:
                self.hosted.pop(handle.pid, None)
            log.info("%s: connection closed; env worker %d stopped", who, handle.pid)


def receive_checkpoint(conn: socket.socket, req: dict, state_dir: str, node: str) -> tuple[str, dict, dict | None]:
    """Unpack the tar that follows ``req`` into a private dir under ``state_dir``; returns (dir,
    timings, streamed). Shared by the agent and the Ray migration hosts.
    ``streamed`` is None for a tar of a whole bundle dir (verify by re-hashing); for
    ``req["stream"] == 2`` (:func:`wire.send_images`) the images land in ``dir/bundle/images``,
    hashed on receipt, and ``streamed = {"digests": ..., "meta": trailer}`` (the trailer is
    not trusted yet: the caller checks its HMAC, session and the digests).
    Raises NoSpaceError, EOFError (cut), tarfile.TarError, OSError; removes the dir then."""
    size = int(req.get("size", -1))
    if size < 0:
        raise ValueError("request has no size")
    st = os.statvfs(state_dir)
    free = st.f_bavail * st.f_frsize
    if size + (1 << 20) > free:
        raise NoSpaceError(f"node {node}: {free} bytes free in {state_dir}, the checkpoint needs {size}")
    wire.send_msg(conn, {"ok": True, "ready": True})  # the sender streams only after this
    d = sessiondir.private_mkdir(os.path.join(state_dir, f"in-{os.urandom(6).hex()}"))
    t0 = time.monotonic()
    streamed = None
    try:
        conn.settimeout(RECEIVE_TIMEOUT_S)
        if req.get("stream") == 3:  # images streamed while CRIU dumped them (wire.send_images_while_dumping)
            digests = {}
            size = wire.receive_images_while_dumped(conn, size, sessiondir.private_mkdir(os.path.join(d, "bundle", "images")),
                                                    digests, str(req.get("hash", "sha256")))
            try:
                meta = wire.recv_msg(conn)
            except ValueError as e:
                raise tarfile.ReadError(f"bad trailer after the images: {e}") from e
            streamed = {"digests": digests, "meta": meta}
        elif req.get("stream") == 2:
            digests: dict = {}
            wire.receive_tar(conn, size, sessiondir.private_mkdir(os.path.join(d, "bundle", "images")), digests)
            try:
                meta = wire.recv_msg(conn)
            except ValueError as e:
                raise tarfile.ReadError(f"bad trailer after the images: {e}") from e
            streamed = {"digests": digests, "meta": meta}
        else:
            wire.receive_tar(conn, size, d)
    except OSError as e:
        shutil.rmtree(d, ignore_errors=True)
        if e.errno == 28:
            raise NoSpaceError(f"node {node}: no space left in {state_dir} while receiving {size} bytes") from e
        raise
    except BaseException:
        shutil.rmtree(d, ignore_errors=True)
        raise
    return d, {"receive_s": time.monotonic() - t0, "bytes": size}, streamed


def relay(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways until either side closes. ``a`` may be a TLS socket."""
    pair = {a: b, b: a}
    while True:
        ready = [a] if isinstance(a, ssl.SSLSocket) and a.pending() else select.select([a, b], [], [])[0]
        for s in ready:
            try:
                data = s.recv(1 << 16)
            except (ConnectionError, ssl.SSLError, OSError):
                return
            if not data:
                return
            pair[s].sendall(data)


# --- CLI ------------------------------------------------------------------------------------------
