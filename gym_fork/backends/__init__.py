"""Snapshot backends: ``criu`` (process checkpoints) and ``pickle`` (in-process cloudpickle)."""

from __future__ import annotations

import logging
import os

from gym_fork.backends.base import Backend
from gym_fork.criu_support import criu_status

log = logging.getLogger("gym_fork")
_announced: set[str] = set()

BACKENDS = ("auto", "criu", "pickle")


def _announce(key: str, level: int, msg: str) -> None:
    if key not in _announced:  # one line per process, not one per env
        _announced.add(key)
        log.log(level, msg)


def get_backend(name: str | Backend = "auto", *, verify: str = "full", worker_log: str | None = None,
                fork_tier: bool | str = "auto") -> Backend:
    """Resolve a backend name to a backend object (``auto``: criu when usable, else pickle)."""
    if isinstance(name, Backend):
        return name
    if name == "criu":
        from gym_fork.backends.criu import CriuBackend

        return CriuBackend(verify=verify, worker_log=worker_log, fork_tier=fork_tier)
    if name == "pickle":
        from gym_fork.backends.pickle import PickleBackend

        return PickleBackend()
    if name == "auto":
        st = criu_status()
        if st.usable and st.mode == "userns":
            _announce("auto-criu", logging.INFO,
                      f"gym_fork: backend 'criu' without root: in-memory snapshots by copy-on-write fork() "
                      f"(when the env worker is single-threaded), CRIU {st.version} inside an unprivileged user "
                      "namespace (--unprivileged) for persist()/save/load/restores of images; no lazy-pages "
                      "migration (needs root)")
            return get_backend("criu", verify=verify, worker_log=worker_log, fork_tier=fork_tier)
        if st.usable:
            _announce("auto-criu", logging.INFO, f"gym_fork: backend 'criu' ({st.binary}, CRIU {st.version})")
            return get_backend("criu", verify=verify, worker_log=worker_log, fork_tier=fork_tier)
        if not st.is_root and fork_tier is not False and hasattr(os, "fork"):
            from gym_fork.backends.criu import CriuBackend

            _announce("auto-fork", logging.WARNING,
                      "gym_fork: backend 'criu' in fork-only mode: in-memory snapshots by copy-on-write fork() "
                      "work without privileges, but CRIU cannot run for this user ("
                      + "; ".join(st.reasons) + "), so persist(), save/load and multi-threaded (torch) "
                      "workers cannot be snapshotted. Run `gym-fork doctor` for details.")
            return CriuBackend(verify=verify, worker_log=worker_log, fork_tier=fork_tier, allow_fork_only=True)
        _announce("auto-pickle", logging.WARNING,
                  "gym_fork: CRIU is not usable (" + "; ".join(st.reasons) + "); using backend 'pickle', "
                  "which refuses envs it cannot copy exactly. Run `gym-fork doctor` for details.")
        return get_backend("pickle")
    raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
