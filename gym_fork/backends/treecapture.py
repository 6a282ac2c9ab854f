"""Deciding how a worker's state can be snapshotted exactly, from what its scan found.

The worker reports what ``fork()`` cannot copy (:mod:`gym_fork.worker.resources`).  Here the
controller decides, per snapshot:

* nothing found: a copy-on-write ``fork()`` snapshot (the fork tier), or a plain CRIU dump;
* only things a CRIU dump of the whole process tree restores exactly: such a dump (children,
  threads, pipes, sockets and ptys between the tree's processes, unlinked files, ...), provided the
  worker can be dumped with its tree (it is the init of its PID namespace and no fork-tier process
  of gym_fork's lives in its tree) and CRIU runs here;
* anything else: :class:`~gym_fork.errors.UncapturableStateError`, naming each resource (pid, fd,
  path or peer) and the fix, before anything was copied.

Example:
    >>> from gym_fork.worker.resources import Resource, Scan
    >>> scan = Scan(pid=42, ns_init=True, resources=[Resource("child", 43, "process 43 (redis-server)", "criu")],
    ...             fork_processes=[], tree=[42, 43])
    >>> check_tree(scan, criu_ok=True, private_network=False)
    ['process 43 (redis-server)']
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import threading
import weakref
from collections.abc import Sequence

from gym_fork.errors import UncapturableStateError
from gym_fork.worker.resources import Resource, Scan

#: the key under which a worker's own network namespace is handed to CRIU (external ``net[INO]``)
NETNS_KEY = "gym_fork-netns"


def _names(rs: list[Resource]) -> str:
    return "; ".join(r.describe() for r in rs)


def check_tree(scan: Scan, *, criu_ok: bool, private_network: bool, unavailable: str | None = None,
               fork_tier_required: bool = False, root: bool = True) -> list[str]:
    """Whether a CRIU dump of the scanned worker's whole tree is exact; the reasons it is needed.

    Args:
        scan: what the worker found.
        criu_ok: CRIU can dump this worker (not fork-only mode).
        private_network: the worker has a network namespace of its own.
        unavailable: why CRIU cannot run here (for the message).
        fork_tier_required: the user asked for ``fork_tier=True``.
        root: CRIU runs as root (else in a user namespace, where a restore cannot mount the devpts
            instance a tree with ptys of its own needs).

    Returns:
        Short descriptions of what only the CRIU dump captures (empty: nothing special).

    Raises:
        UncapturableStateError: something would not be captured exactly; names it and the fix.
    """
    res = scan.resources
    none = [r for r in res if r.capture == "none"]
    if not private_network:
        none += [r for r in res if r.capture == "criu+netns"]
    if not root:  # (copies: the scan is the caller's)
        none += [dataclasses.replace(r, capture="none", fix=(
            "a pty the env opened is captured only by CRIU as root (a restore mounts a devpts of its own); "
            "run as root, or talk to the tool over pipes")) for r in res if r.kind == "pty" and r.capture == "criu"]
    if none:
        fixes = list(dict.fromkeys(r.fix for r in none if r.fix))
        raise UncapturableStateError(
            f"gym_fork cannot snapshot this env exactly: its worker (pid {scan.pid}) holds "
            f"{_names(none)}. To fix: " + " | ".join(fixes) + ". Nothing was copied; the env keeps running.",
            none)
    need = [r for r in res if r.capture in ("criu", "criu+netns")]
    if not need:
        return []
    what = [r.what for r in need]
    if fork_tier_required:
        raise UncapturableStateError(
            f"fork_tier=True, but a fork() copy of this env's worker (pid {scan.pid}) would not be exact: it "
            f"holds {_names(need)}. Use fork_tier='auto' (a CRIU dump of the whole process tree then) or False.",
            need)
    if not criu_ok:
        raise UncapturableStateError(
            f"gym_fork cannot snapshot this env exactly: its worker (pid {scan.pid}) holds {_names(need)}, which "
            f"a copy-on-write fork() does not copy and only a CRIU dump of the whole process tree captures, and "
            f"CRIU is unavailable here ({unavailable or 'see `gym-fork doctor`'}). To fix: run as root or enable "
            "unprivileged user namespaces so that CRIU runs (`gym-fork doctor` says how); or keep the env's "
            "state in its own memory (no threads, child processes or open files between steps).", need)
    if not scan.ns_init or scan.fork_processes:
        why = ("it runs as a copy-on-write clone (restored or forked from an in-memory snapshot, or moved "
               "to one when a snapshot of it was first copied into another env: fork(), explore(), another "
               "vector slot), which CRIU cannot dump together with its child processes" if not scan.ns_init else
               f"its process tree also holds gym_fork's in-memory snapshots or branches (pids "
               f"{scan.fork_processes}), which a dump of the whole tree would include")
        raise UncapturableStateError(
            f"gym_fork cannot snapshot this env exactly now: its worker (pid {scan.pid}) holds {_names(need)}, "
            f"which a copy-on-write fork() does not copy, and {why}. To fix: create the env with "
            "ForkableEnv(..., fork_tier=False), so every snapshot is a CRIU dump of the whole process tree "
            "from the start. Nothing was copied; the env keeps running.", need)
    return what


def dump_options(scan: Scan | None, private_network: bool) -> dict:
    """Extra CRIU options a dump of the scanned tree needs (pycriu ``opts`` field -> value)."""
    from gym_fork.worker.resources import GHOST_LIMIT

    opts: dict = {"ghost_limit": GHOST_LIMIT}
    if private_network:
        # Every connection end is in the frozen tree (its own network namespace has only lo), so
        # nothing can arrive during the dump: no firewall lock needed.
        opts.update(tcp_established=True, network_lock=3)  # CRIU_NETWORK_LOCK_SKIP
    return opts


#: how a summary counts resources of a kind whose name is not a noun plus "s"
_PLURAL = {"shared-memory": "shared memory mappings", "shared-mapping": "shared file mappings",
           "anon-inode": "anonymous-inode descriptors", "udp-socket": "UDP sockets", "file-lock": "file locks"}


def summary(resources: list[Resource]) -> str:
    """``"2 child processes (python, redis-server), 3 pipes, 1 thread"``: what a scan found, by kind."""
    kinds: dict[str, list[Resource]] = {}
    for r in resources:
        kinds.setdefault(r.kind, []).append(r)
    parts = []
    for kind, rs in kinds.items():
        if kind == "child":
            names = ", ".join(dict.fromkeys(r.what.split("(", 1)[-1].rstrip(")") for r in rs))
            parts.append(f"{len(rs)} child process{'es' if len(rs) > 1 else ''} ({names})")
        elif kind == "thread":
            parts.append(rs[0].what)
        elif kind == "pty":  # one per pty, not per descriptor (a shell holds its terminal 4 times)
            n = len({(r.detail.get("dev"), r.detail.get("index")) for r in rs})
            parts.append(f"{n} pty{'s' if n > 1 else ''} the env opened")
        elif len(rs) == 1:
            parts.append(rs[0].what)
        else:
            parts.append(f"{len(rs)} {_PLURAL.get(kind) or kind.replace('-', ' ') + 's'}")
    return ", ".join(parts)


def describe_switch(scan: Scan, moved: int = 0) -> str:
    """The one log line an env gets when its snapshots become CRIU dumps of its whole tree."""
    need = [r for r in scan.resources if r.capture != "none"]
    also = (f" ({moved} earlier in-memory snapshot{'s were' if moved > 1 else ' was'} written as CRIU images "
            "first)" if moved else "")
    return (f"gym_fork: env worker {scan.pid} holds what a copy-on-write fork() does not copy ({summary(need)}); "
            f"its snapshots are CRIU dumps of the whole process tree from now on{also}")


# The in-memory (fork-tier) snapshots each worker made, so that they can be moved out of its
# tree (written as images, their frozen processes ended) before the first whole-tree dump.
_frozen: "weakref.WeakKeyDictionary[object, weakref.WeakSet]" = weakref.WeakKeyDictionary()


def remember_frozen(handle: object, payload: object) -> None:
    try:
        _frozen.setdefault(handle, weakref.WeakSet()).add(payload)
    except TypeError:  # not weak-referenceable: such snapshots are simply not moved (then refused)
        pass


def frozen_of(handle: object) -> list:
    """The live in-memory snapshots forked from ``handle``'s worker (frozen processes in its tree)."""
    try:
        ws = _frozen.get(handle)
    except TypeError:
        return []
    return [p for p in (ws or ()) if getattr(p, "chan", None) is not None]


#: written next to the images of a tree whose restores must not run at the same time
SERIAL_MARK = "gym_fork-serial-restore"
_serial = threading.Lock()


def needs_serial_restore(scan: Scan | None) -> bool:
    """Whether restores of this tree's images collide when they run at the same time: CRIU
    re-creates unlinked files and binds unix sockets whose path was unlinked at their old paths
    while it restores (and removes them again), so two restores at once fight over those paths."""
    return scan is not None and any(
        r.kind == "unlinked-file" or (r.kind == "listener" and r.capture == "criu") for r in scan.resources)


#: written next to the images of a tree that holds ptys of its own (an interactive shell)
DEVPTS_MARK = "gym_fork-devpts"


def mark_images(images_dir: str, scan: Scan | None) -> None:
    """Note in a fresh image directory (before its manifest) what restoring it needs."""
    if needs_serial_restore(scan):
        with open(os.path.join(images_dir, SERIAL_MARK), "w") as f:
            f.write("unlinked files or unix socket paths are re-created at their old paths during a restore\n")
    if scan is not None and any(r.kind == "pty" and r.capture == "criu" for r in scan.resources):
        with open(os.path.join(images_dir, DEVPTS_MARK), "w") as f:
            f.write("the tree's ptys are restored in a devpts instance of its own, each with its old number\n")


def needs_devpts(images_dir: str) -> bool:
    """Whether the tree in ``images_dir`` holds ptys of its own (see :func:`mark_images`)."""
    return os.path.exists(os.path.join(images_dir, DEVPTS_MARK))


def image_lock(images_dir: str):
    """A process-wide lock around restores of images marked by :func:`mark_images` (or holding
    CRIU ghost files); other images restore concurrently (a no-op context)."""
    try:
        serial = any(n == SERIAL_MARK or n.startswith("ghost-file-") for n in os.listdir(images_dir))
    except OSError:
        serial = False
    return _serial if serial else contextlib.nullcontext()


def tree_process_naming(pid: int, paths: Sequence[str]) -> str | None:
    """The first descendant of process ``pid`` whose working directory, command line or
    environment names a path in (or equal to) one of ``paths``, described for an error message
    ("pid 12 (python3): its working directory /x/ws"), or None.

    Where a restored or cloned tree cannot be shown its own workspace at the paths it knew (no
    mount namespaces without root), a process of it that knows the old path would go on working
    in another env's directory; these are the ways a tool is usually told where to work."""
    from gym_fork.criu.status import children_by_parent

    kids = children_by_parent()
    todo, seen = list(kids.get(pid, ())), set()
    wanted = [os.fsencode(p.rstrip("/")) for p in paths if p]
    # a whole path: not DIR inside DIR.branch-<id> (a copy's own directory)
    pattern = re.compile(b"(" + b"|".join(re.escape(w) for w in wanted) + rb")(?=[/\0:=\s'\"]|$)") if wanted else None

    def named(blob: bytes) -> bytes | None:
        m = pattern.search(blob) if pattern is not None else None
        return m.group(1) if m else None

    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        todo.extend(kids.get(p, ()))
        try:
            with open(f"/proc/{p}/comm", "rb") as f:
                comm = os.fsdecode(f.read().strip())
        except OSError:
            continue
        try:
            cwd = os.fsencode(os.readlink(f"/proc/{p}/cwd"))
            if named(cwd + b"/"):
                return f"pid {p} ({comm}): its working directory {os.fsdecode(cwd)}"
        except OSError:
            pass
        for what, source in (("command line", "cmdline"), ("environment", "environ")):
            try:
                with open(f"/proc/{p}/{source}", "rb") as f:
                    blob = f.read()
            except OSError:
                continue
            hit = named(blob)
            if hit is not None:
                return f"pid {p} ({comm}): its {what} names {os.fsdecode(hit)}"
    return None
