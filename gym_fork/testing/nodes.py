"""Local "nodes" for demos, tests and benchmarks: network namespaces joined by a veth pair (when
root), each running a ``gym-fork agent`` started with ``nsenter --net=`` (not ``ip netns exec``,
which would also unshare the mount namespace CRIU then has to handle); else agents on loopback
ports with separate state directories.  Everything created is removed by ``close()``."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

_LISTEN = re.compile(r"listening on (\S+):(\d+)")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class AgentProcess:
    stop_timeout = 10.0  # seconds a SIGTERMed agent gets before SIGKILL

    def __init__(self, name: str, state_dir: str, token_file: str, *, host: str = "127.0.0.1",
                 netns: str | None = None, cert: str | None = None, key: str | None = None,
                 log_path: str | None = None, args: tuple[str, ...] = (), launcher: tuple[str, ...] = ()):
        """``launcher``: a command that execs the agent (e.g. ``("prlimit", "--nofile=128:128", "--")``)."""
        self.name, self.state_dir, self.netns = name, state_dir, netns
        self.log_path = log_path or os.path.join(os.path.dirname(state_dir), f"agent-{name}.log")
        cmd = [sys.executable, "-m", "gym_fork.cli", "agent", "--host", host, "--port", "0",
               "--state-dir", state_dir, "--token-file", token_file, "--node", name]
        if cert:
            cmd += ["--cert", cert, "--key", key]
        cmd += list(args)
        if netns:
            cmd = ["nsenter", f"--net=/run/netns/{netns}", *cmd]
        cmd = [*launcher, *cmd]
        self._log = open(self.log_path, "ab")
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([pkg_root, os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log,
                                     env=env, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            m = _LISTEN.search(self.log())
            if m:
                self.target = f"{m.group(1)}:{m.group(2)}"
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"agent {name} did not start:\n{self.log()[-2000:]}")
            time.sleep(0.05)

    @property
    def pid(self) -> int:
        """pid of the agent's python (nsenter execs it, so it is the same process)."""
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

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
        """The agent's child processes, whichever of its threads started them (a worker restored
        by a connection thread moves to another thread when that one ends: see
        :func:`gym_fork.criu.status.children_by_parent`)."""
        from gym_fork.criu.status import children_by_parent

        return sorted(children_by_parent().get(self.pid, []))

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class Nodes:
    """``Nodes(["A", "B"])``: one agent per node; ``.target[name]``, ``.netns[name]`` (None on
    loopback), ``.token``, ``.token_file``; a context manager. Agents speak TLS with a
    certificate of their own; ``tls=True``: with one made here (``.cert``, for clients' ``tls=``);
    ``insecure=True``: plain TCP (clients pass ``insecure=True``)."""

    def __init__(self, names=("A", "B"), *, use_netns: bool | None = None, prefix: str | None = None,
                 tls: bool = False, insecure: bool = False):
        self.dir = tempfile.mkdtemp(prefix="gfm-nodes-")
        os.chmod(self.dir, 0o700)
        self.token = os.urandom(16).hex()
        self.token_file = os.path.join(self.dir, "token")
        with open(os.open(self.token_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(self.token)
        self.use_netns = (os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("nsenter") is not None) \
            if use_netns is None else use_netns
        self.prefix = prefix or f"gfm{os.getpid() % 100000}{os.urandom(2).hex()}"
        self.netns: dict[str, str | None] = {}
        self.addr: dict[str, str] = {}
        self.agents: dict[str, AgentProcess] = {}
        self.target: dict[str, str] = {}
        self.cert = self.key = None
        try:
            if tls:
                self.cert, self.key = os.path.join(self.dir, "cert.pem"), os.path.join(self.dir, "key.pem")
                subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                                "-subj", "/CN=gym-fork-agent", "-keyout", self.key, "-out", self.cert],
                               check=True, capture_output=True)
            if self.use_netns:
                self._make_netns(list(names))
            for name in names:
                self.agents[name] = AgentProcess(
                    name, os.path.join(self.dir, f"state-{name}"), self.token_file,
                    host=self.addr.get(name, "127.0.0.1"), netns=self.netns.get(name),
                    cert=self.cert, key=self.key, args=("--insecure",) if insecure else ())
                self.target[name] = self.agents[name].target
        except BaseException:
            self.close()
            raise

    def _make_netns(self, names: list[str]) -> None:
        if len(names) != 2:
            raise ValueError("netns mode joins exactly two nodes with one veth pair")
        sub = (os.getpid() % 200) + 20
        for i, name in enumerate(names):
            ns = f"{self.prefix}-{name.lower()}"
            _ip("netns", "add", ns)
            self.netns[name] = ns
            self.addr[name] = f"10.231.{sub}.{i + 1}"
        a, b = names
        va, vb = f"{self.prefix[:10]}a", f"{self.prefix[:10]}b"
        _ip("link", "add", va, "netns", self.netns[a], "type", "veth", "peer", "name", vb, "netns", self.netns[b])
        for name, dev in ((a, va), (b, vb)):
            ns = self.netns[name]
            _ip("-n", ns, "addr", "add", f"{self.addr[name]}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def close(self) -> None:
        for ag in self.agents.values():
            ag.stop()
        self.agents.clear()
        for ns in self.netns.values():
            if ns:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.netns.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "Nodes":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
