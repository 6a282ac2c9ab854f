"""What the attack tests share: a real `gym-fork agent` process (with resource limits when asked),
a raw client that speaks the agent's wire (TLS unless the agent speaks plain TCP), and readings
of the agent's threads and memory from /proc. Nothing is mocked."""

from __future__ import annotations

import json
import os
import select
import socket
import ssl
import struct
import subprocess
import tempfile
import time

from gym_fork.testing.nodes import AgentProcess

LEN = struct.Struct("!I")


class AgentProc(AgentProcess):
    """``gym-fork agent`` on loopback in its own process, with a token and directories of its own.

    Args:
        args: extra command-line arguments.
        nofile: RLIMIT_NOFILE (soft and hard) of the agent, set before it starts.
    """

    stop_timeout = 20.0  # an agent under attack may take longer to wind down

    def __init__(self, *args: str, nofile: int | None = None):
        self.dir = tempfile.mkdtemp(prefix="gfsec-")
        self.token = os.urandom(16).hex()
        self.token_file = os.path.join(self.dir, "token")
        with open(os.open(self.token_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(self.token)
        # prlimit(1) sets the limit and execs the agent: it holds from the agent's start
        launcher = ("prlimit", f"--nofile={nofile}:{nofile}", "--") if nofile is not None else ()
        super().__init__("B", os.path.join(self.dir, "state"), self.token_file,
                         log_path=os.path.join(self.dir, "agent.log"), args=args, launcher=launcher)
        host, _, port = self.target.rpartition(":")
        self.host, self.port = host, int(port)

    def stop(self) -> None:
        super().stop()
        subprocess.run(["rm", "-rf", self.dir], check=False)


def speaks_first(sock: socket.socket, wait: float = 1.0) -> bool:
    """Whether the peer sends before we do: a plain-TCP agent sends its hello at once; a TLS
    agent waits for our ClientHello."""
    return bool(select.select([sock], [], [], wait)[0])


def open_raw(target: str, timeout: float = 20.0, *, tls: bool | None = None) -> socket.socket:
    """A connection to the agent ready for its wire protocol: TLS accepted without checks (an
    attacker has no certificate to check) unless the agent speaks plain TCP (``tls=None``:
    found out by waiting a second for the agent to speak first)."""
    host, port = target.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    if tls is False or (tls is None and speaks_first(sock)):
        return sock
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx.wrap_socket(sock)


def send_frame(sock: socket.socket, body: bytes) -> None:
    sock.sendall(LEN.pack(len(body)) + body)


def recv_frame(sock: socket.socket) -> dict:
    def exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise EOFError("closed")
            buf += chunk
        return buf

    (n,) = LEN.unpack(exact(4))
    return json.loads(exact(n))


def closed_by_peer(sock: socket.socket, within: float) -> bool:
    """Whether the peer closes ``sock`` within ``within`` seconds (whatever it sends first is read
    and dropped)."""
    end = time.monotonic() + within
    while (left := end - time.monotonic()) > 0:
        if isinstance(sock, ssl.SSLSocket) and sock.pending():
            sock.recv(65536)
            continue
        if not select.select([sock], [], [], left)[0]:
            return False
        try:
            if not sock.recv(65536):
                return True
        except (OSError, ssl.SSLError):
            return True
    return False


def wait_for(pred, timeout: float = 15.0) -> bool:
    """``pred()`` became true within ``timeout`` seconds (polled)."""
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True
