"""Where a job can move: one target kind per address scheme, found through a registry.

An address is ``"host:port"`` (a ``gym-fork agent``; built in) or ``"<scheme>:<rest>"`` for a
kind that a plugin provides (the Ray plugin's ``"ray:<node id>"``). Plugins register a
:class:`TargetKind` subclass under the entry-point group :data:`ENTRY_POINT_GROUP` (entry-point
name = the scheme); it is loaded the first time an address of that scheme is parsed. The core
therefore never imports a plugin: it only knows this protocol.

Example:
    >>> from gym_fork.migration.targets import TargetContext, Targets
    >>> targets = Targets(TargetContext(token=b"secret"))
    >>> type(targets.kind("10.0.0.2:7000")).__name__, targets.describe("10.0.0.2:7000")
    ('AgentTarget', 'the target agent (10.0.0.2:7000)')
    >>> targets.kind("no port here")
    Traceback (most recent call last):
    ...
    ValueError: target must be 'host:port', not 'no port here'
"""

from __future__ import annotations

import re
import socket
import threading
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, ClassVar

from gym_fork.errors import MigrationError
from gym_fork.migration.wire.connect import connect, parse_host_port

ENTRY_POINT_GROUP = "gym_fork.migration_targets"
_SCHEME_NAME = r"[a-z][a-z0-9+.-]*"
_SCHEME = re.compile(rf"({_SCHEME_NAME}):")  # an address's prefix: matched at its start


@dataclass
class TargetContext:
    """What a supervisor knows for connecting anywhere.

    Attributes:
        token: the shared token of the agents (None: agents refuse to be targets; a plugin may
            derive its own).
        tls: how agents' certificates are checked besides the token handshake that covers them:
            False (only that), True (also the system CAs) or a CA file.
        insecure: plain TCP to agents started with ``--insecure`` (no encryption, nothing
            authenticated after the handshake).
        netns: a network namespace to connect to agents from.
        options: settings for plugins' kinds (e.g. ``{"ray_address": ...}``), by name.
    """

    token: bytes | None = None
    tls: bool | str = False
    insecure: bool = False
    netns: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class Connection:
    """An authenticated connection to a target, ready for a request (e.g. ``op="job"``).

    Attributes:
        sock: the socket; the caller closes it.
        hello: the peer's hello (``node``, ``nonce``: what a checkpoint must be signed for).
        token: the token the handshake used (its :func:`~gym_fork.migration.wire.auth.bundle_key`
            signs the checkpoint).
        prewarmed: the route had been prepared, so nothing slow happened now.
        timings: seconds spent in steps worth reporting, by name.
    """

    sock: socket.socket
    hello: dict
    token: bytes
    prewarmed: bool = False
    timings: dict[str, float] = field(default_factory=dict)


class TargetKind:
    """One scheme of target addresses. A supervisor makes one instance per scheme it uses, so a
    kind may keep state (warm routes) until :meth:`close`."""

    scheme: ClassVar[str] = ""

    def __init__(self, ctx: TargetContext):
        self.ctx = ctx

    def parse(self, address: str) -> Any:
        """The address's parts. Raises ValueError when it is malformed."""
        raise NotImplementedError

    def connect(self, address: str) -> Connection:
        """Connect and authenticate. Raises a :class:`~gym_fork.errors.MigrationError`."""
        raise NotImplementedError

    def prepare(self, addresses: list[str]) -> None:
        """Get ready for moves to ``addresses`` (all of this scheme), without blocking: e.g. start
        the hosts there and keep them warm. Default: nothing to do."""

    def describe(self, address: str) -> str:
        """The address in words, for messages."""
        return address

    def close(self) -> None:
        """Stop whatever :meth:`prepare` started (the job moved or ended)."""


class AgentTarget(TargetKind):
    """A ``gym-fork agent`` at ``"host:port"``."""

    def parse(self, address: str) -> tuple[str, int]:
        return parse_host_port(address)

    def connect(self, address: str) -> Connection:
        if not self.ctx.token:
            raise MigrationError(f"no token to authenticate to the agent at {address}: start `gym-fork run` "
                                 "with --token-file or $GYM_FORK_TOKEN")
        sock, hello = connect(address, self.ctx.token, tls=self.ctx.tls, insecure=self.ctx.insecure,
                              netns=self.ctx.netns)
        return Connection(sock, hello, self.ctx.token)

    def describe(self, address: str) -> str:
        return f"the target agent ({address})"


_lock = threading.Lock()
_kinds: dict[str, type[TargetKind]] = {"": AgentTarget}
_not_installed: set[str] = set()


def register(scheme: str, kind: type[TargetKind]) -> None:
    """Make ``"<scheme>:..."`` addresses resolve to ``kind`` (what the entry point does).

    Raises:
        ValueError: ``scheme`` is not a lowercase URI scheme, or is taken by another kind.
    """
    if not isinstance(scheme, str) or not re.fullmatch(_SCHEME_NAME, scheme):
        raise ValueError(f"not a target scheme: {scheme!r}")
    with _lock:
        if _kinds.get(scheme, kind) is not kind:
            raise ValueError(f"target scheme {scheme!r} is registered already ({_kinds[scheme].__name__})")
        _kinds[scheme] = kind
        _not_installed.discard(scheme)


def _installed(scheme: str) -> bool:
    """Whether a kind serves ``scheme``, loading its entry point the first time it is asked."""
    with _lock:
        if scheme in _kinds:
            return True
        if scheme in _not_installed:
            return False
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == scheme]
    for ep in found:
        try:
            kind = ep.load()
        except Exception as e:  # noqa: BLE001 - a broken plugin: say which
            raise ValueError(f"the {scheme!r} target kind ({ep.value}) failed to load: "
                             f"{type(e).__name__}: {e}") from e
        register(scheme, kind)
    with _lock:
        if scheme not in _kinds:
            _not_installed.add(scheme)
        return scheme in _kinds


def scheme_of(address: str) -> str:
    """The scheme of ``address``: ``""`` for ``"host:port"``.

    Raises:
        TypeError: not a string.
        ValueError: neither a known scheme's address nor ``"host:port"``.
    """
    if not isinstance(address, str):
        raise TypeError(f"a target address is a string, not {type(address).__name__}")
    m = _SCHEME.match(address)
    if m and _installed(m.group(1)):
        return m.group(1)
    parse_host_port(address)  # a hostname before the colon: an agent's address, or nothing
    return ""


class Targets:
    """The target kinds one supervisor uses, each made on first use with the same context."""

    def __init__(self, ctx: TargetContext):
        self.ctx = ctx
        self._made: dict[str, TargetKind] = {}
        self._lock = threading.Lock()

    def kind(self, address: str) -> TargetKind:
        """The kind serving ``address`` (its address parsed once, so a malformed one raises
        ValueError here)."""
        scheme = scheme_of(address)
        with self._lock:
            k = self._made.get(scheme)
            if k is None:
                k = self._made[scheme] = _kinds[scheme](self.ctx)
        k.parse(address)
        return k

    def connect(self, address: str) -> Connection:
        return self.kind(address).connect(address)

    def describe(self, address: str) -> str:
        try:
            return self.kind(address).describe(address)
        except (TypeError, ValueError):
            return repr(address)

    def prepare(self, addresses: list[str]) -> None:
        """:meth:`TargetKind.prepare` for each kind, with its addresses (malformed ones skipped:
        a move there reports them)."""
        by_kind: dict[int, tuple[TargetKind, list[str]]] = {}
        for a in addresses:
            try:
                k = self.kind(a)
            except (TypeError, ValueError):
                continue
            by_kind.setdefault(id(k), (k, []))[1].append(a)
        for k, addrs in by_kind.values():
            k.prepare(addrs)

    def close(self) -> None:
        with self._lock:
            made = list(self._made.values())
        for k in made:
            k.close()
