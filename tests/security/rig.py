"""What the attack tests share: a real `gym-fork agent` process (with resource limits when asked),
a raw client that speaks the agent's wire (TLS unless the agent speaks plain TCP), and readings
of the agent's threads and memory from /proc. Nothing is mocked."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import time

import gym_fork

PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(gym_fork.__file__)))
_LISTEN = re.compile(r"listening on (\S+):(\d+)")
LEN = struct.Struct("!I")


class AgentProc:
    """``gym-fork agent`` on loopback in its own process.

    Args:
        args: extra command-line arguments.
        nofile: RLIMIT_NOFILE (soft and hard) of the agent, set before it starts.
    """

    def __init__(self, *args: str, nofile: int | None = None):
        self.dir = tempfile.mkdtemp(prefix="gfsec-")
        self.token = os.urandom(16).hex()
        self.token_file = os.path.join(self.dir, "token")
        with open(os.open(self.token_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(self.token)
        self.state_dir = os.path.join(self.dir, "state")
        self.log_path = os.path.join(self.dir, "agent.log")
        cmd = [sys.executable, "-m", "gym_fork.cli", "agent", "--host", "127.0.0.1", "--port", "0",
               "--state-dir", self.state_dir, "--token-file", self.token_file, "--node", "B", *args]
        if nofile is not None:  # prlimit(1) sets it and execs the agent: the limit holds from its start
            cmd = ["prlimit", f"--nofile={nofile}:{nofile}", "--", *cmd]

        self._log = open(self.log_path, "ab")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([PKG_ROOT, os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log, env=env,
                                     start_new_session=True)
        deadline = time.monotonic() + 60
        while not (m := _LISTEN.search(self.log())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"agent did not start:\n{self.log()[-3000:]}")
            time.sleep(0.05)
        self.host, self.port = m.group(1), int(m.group(2))
        self.target = f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def status(self) -> dict[str, int]:
        """``Threads`` and ``VmRSS`` (KiB) of the agent, from /proc."""
        out = {}
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("Threads", "VmRSS"):
                    out[key] = int(value.split()[0])
        return out

    def children(self) -> list[int]:
        out: list[int] = []
        try:
            for t in os.listdir(f"/proc/{self.pid}/task"):
                with open(f"/proc/{self.pid}/task/{t}/children") as f:
                    out += [int(x) for x in f.read().split()]
        except OSError:
            pass
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
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
