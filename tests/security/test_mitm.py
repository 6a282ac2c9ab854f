"""An attacker on the network path between a learner and an agent, who does not know the token.

A relay written here (a real TCP proxy on loopback) forwards a real migration faithfully, then
injects a worker-channel frame whose pickle would create a marker file when unpickled -- into
the learner and into the migrated worker. And a relay that ends TLS itself (its own
certificate) in the middle of the token handshake. Neither may get anything unpickled or
restored: the stream is TLS, and the token handshake covers the agent's certificate.
"""

from __future__ import annotations

import os
import pickle
import socket
import ssl
import struct
import subprocess
import threading

import pytest

import gym_fork
from gym_fork.errors import WorkerDiedError
from gym_fork.migration import AgentUnreachableError, AuthenticationError
from tests.conftest import assert_same_traj, run_actions
from tests.security.rig import AgentProc, wait_for

pytestmark = pytest.mark.criu
ENV = "CartPole-v1"
ACTIONS = [i % 2 for i in range(30)]


class _Mkdir:
    """Unpickling this makes a directory: proof that an injected pickle ran."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def channel_frame(obj) -> bytes:
    """One frame of the worker channel: an 8-byte length, then the pickle."""
    data = pickle.dumps(obj, protocol=5)
    return struct.pack("!Q", len(data)) + data


class Relay:
    """A one-connection TCP relay between a client and ``upstream``. ``inject(to_agent,
    to_client)`` writes bytes of its own into either direction. ``terminate_tls``: end TLS here
    with a certificate of our own (as an attacker can) and open our own TLS to the agent."""

    def __init__(self, upstream: str, *, terminate_tls: bool = False, cert_dir: str | None = None):
        host, port = upstream.rsplit(":", 1)
        self.up = (host, int(port))
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.target = f"127.0.0.1:{self.srv.getsockname()[1]}"
        self.terminate_tls = terminate_tls
        self.cert_dir = cert_dir
        self.c = self.u = None
        self.locks = {"c": threading.Lock(), "u": threading.Lock()}
        self.ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        c, _ = self.srv.accept()
        u = socket.create_connection(self.up)
        if self.terminate_tls:
            cert, key = os.path.join(self.cert_dir, "mitm.pem"), os.path.join(self.cert_dir, "mitm.key")
            subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                            "-nodes", "-days", "1", "-subj", "/CN=gym-fork agent B", "-keyout", key, "-out", cert],
                           check=True, capture_output=True)
            sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            sctx.load_cert_chain(cert, key)
            cctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            cctx.check_hostname, cctx.verify_mode = False, ssl.CERT_NONE
            try:
                c = sctx.wrap_socket(c, server_side=True)
                u = cctx.wrap_socket(u)
            except (OSError, ssl.SSLError):
                c.close()
                u.close()
                self.ready.set()
                return
        self.c, self.u = c, u
        self.ready.set()
        threading.Thread(target=self._pump, args=(u, c, "c"), daemon=True).start()
        self._pump(c, u, "u")

    def _pump(self, src: socket.socket, dst: socket.socket, lock: str) -> None:
        try:
            while data := src.recv(65536):
                with self.locks[lock]:
                    dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def inject(self, to_agent: bytes = b"", to_client: bytes = b"") -> None:
        self.ready.wait(30)
        for name, sock, data in (("u", self.u, to_agent), ("c", self.c, to_client)):
            if data and sock is not None:
                with self.locks[name]:
                    try:
                        sock.sendall(data)
                    except OSError:
                        pass


@pytest.fixture
def agent():
    a = AgentProc()
    yield a
    a.stop()


def _envs():
    envs = [gym_fork.make(ENV), gym_fork.make(ENV)]
    for e in envs:
        e.reset(seed=7)
        run_actions(e, ACTIONS[:10])
    return envs


def test_relay_injecting_after_the_handshake_gets_nothing_unpickled(agent, tmp_path):
    """The relay passes the whole migration through, then injects a pickle frame both ways:
    neither the learner nor the migrated worker unpickles it; the connection ends (the env
    reports its worker gone) and the agent stops the worker."""
    env, ref = _envs()
    relay = Relay(agent.target)
    markers = {side: str(tmp_path / f"pwned-{side}") for side in ("worker", "learner")}
    try:
        env.migrate(relay.target, token=agent.token)
        assert_same_traj(run_actions(env, ACTIONS)[0], run_actions(ref, ACTIONS)[0])  # the relay is faithful
        relay.inject(to_agent=channel_frame(("step", (_Mkdir(markers["worker"]),))),
                     to_client=channel_frame((0, _Mkdir(markers["learner"]))))
        raised = None
        try:
            for a in ACTIONS:
                env.step(a)
        except Exception as e:  # noqa: BLE001 - checked below, after the markers
            raised = e
    finally:
        env.close()
        ref.close()
    assert not os.path.exists(markers["worker"]), "the migrated worker unpickled an injected frame"
    assert not os.path.exists(markers["learner"]), "the learner unpickled an injected frame"
    assert isinstance(raised, WorkerDiedError), raised
    assert wait_for(lambda: "stopped" in agent.log() and not agent.children()), agent.log()[-2000:]


def test_relay_that_ends_tls_itself_fails_the_handshake(agent, tmp_path):
    """A relay with a certificate of its own sits between two TLS sessions and forwards the token
    handshake: the proofs cover the certificate each side saw, so both sides refuse; nothing
    moves, and what the relay injects afterwards reaches nobody."""
    env, ref = _envs()
    relay = Relay(agent.target, terminate_tls=True, cert_dir=str(tmp_path))
    marker = str(tmp_path / "pwned")
    try:
        with pytest.raises(AuthenticationError):
            env.migrate(relay.target, token=agent.token, timeout=20)
        relay.inject(to_agent=channel_frame(("step", (_Mkdir(marker),))), to_client=channel_frame((0, _Mkdir(marker))))
        assert_same_traj(run_actions(env, ACTIONS)[0], run_actions(ref, ACTIONS)[0])  # still here, unchanged
    finally:
        env.close()
        ref.close()
    assert not os.path.exists(marker)
    assert "REFUSED" in agent.log()
    assert agent.children() == []


def test_plain_tcp_only_when_both_sides_say_insecure(tmp_path):
    """No silent downgrade: a client that did not ask for plain TCP cannot talk to an --insecure
    agent (and is told why), and an insecure client cannot talk to a TLS agent."""
    from gym_fork.migration.wire.connect import connect
    from gym_fork.migration.wire.messages import recv_msg, send_msg

    plain, tls = AgentProc("--insecure"), AgentProc()
    try:
        with pytest.raises(AgentUnreachableError, match="--insecure"):
            connect(plain.target, plain.token.encode(), timeout=5)
        with pytest.raises(AgentUnreachableError):
            connect(tls.target, tls.token.encode(), timeout=3, insecure=True)
        for agent, kw in ((plain, {"insecure": True}), (tls, {})):
            sock, hello = connect(agent.target, agent.token.encode(), **kw)
            with sock:
                assert isinstance(sock, ssl.SSLSocket) != bool(kw)
                send_msg(sock, {"op": "ping"})
                assert recv_msg(sock)["ok"]
        assert "INSECURE" in plain.log()
    finally:
        plain.stop()
        tls.stop()


def test_job_targets_connect_over_tls(agent):
    """Whole jobs (``gym-fork run``) reach agents through the target registry: TLS there too."""
    from gym_fork.migration.targets import TargetContext, Targets

    conn = Targets(TargetContext(token=agent.token.encode())).connect(agent.target)
    with conn.sock:
        assert isinstance(conn.sock, ssl.SSLSocket) and conn.sock.version() in ("TLSv1.2", "TLSv1.3")
