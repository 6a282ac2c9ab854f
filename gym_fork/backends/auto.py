"""``backend="auto"``: which backend this machine and this env get.

CRIU when it is usable here (as root, or without root inside an unprivileged user namespace);
inside a ``gym-fork run`` job, CRIU in fork-only mode (the job is what CRIU moves); without CRIU
for this user, copy-on-write ``fork()`` snapshots only; else the pickle backend.  A fork-only
worker that turns out to be unsafe to fork (several threads, torch) is handed to the pickle
backend at start-up where that is exact, else refused then (:func:`start_env`).  Each choice is
logged once per process.
"""

from __future__ import annotations

import logging
import os

from gym_fork.backends.base import Backend, Handle
from gym_fork.backends.criu import CriuBackend
from gym_fork.backends.pickle import PickleBackend
from gym_fork.criu.status import criu_status
from gym_fork.errors import BackendUnavailableError, GymForkError
from gym_fork.worker.commands import EnvSource

log = logging.getLogger("gym_fork")
_announced: set[str] = set()


def _announce(key: str, level: int, msg: str) -> None:
    if key not in _announced:  # one line per process, not one per env
        _announced.add(key)
        log.log(level, msg)


def choose(*, verify: str = "full", worker_log: str | None = None, fork_tier: bool | str = "auto",
           private_network: bool = False) -> Backend:
    """The backend ``"auto"`` stands for here (the options are :class:`CriuBackend`'s)."""
    st = criu_status()
    opts = dict(verify=verify, worker_log=worker_log, fork_tier=fork_tier, private_network=private_network)
    if st.usable and os.environ.get("GYM_FORK_CONTROL_FD"):
        _announce("auto-job", logging.INFO,
                  "gym_fork: backend 'criu' in fork-only mode inside this `gym-fork run` job: snapshots are "
                  "copy-on-write forks; the whole job (workers and snapshots included) is what CRIU moves")
        return CriuBackend(**opts)
    if st.usable and st.mode == "userns":
        _announce("auto-criu", logging.INFO,
                  f"gym_fork: backend 'criu' without root: in-memory snapshots by copy-on-write fork() "
                  f"(when the env worker is single-threaded), CRIU {st.version} inside an unprivileged user "
                  "namespace (--unprivileged) for persist()/save/load/restores of images; no lazy-pages "
                  "migration (needs root)")
        return CriuBackend(**opts)
    if st.usable:
        _announce("auto-criu", logging.INFO, f"gym_fork: backend 'criu' ({st.binary}, CRIU {st.version})")
        return CriuBackend(**opts)
    if not st.is_root and fork_tier is not False and hasattr(os, "fork"):
        _announce("auto-fork", logging.WARNING,
                  "gym_fork: backend 'criu' in fork-only mode: in-memory snapshots by copy-on-write fork() "
                  "work without privileges, but CRIU cannot run for this user ("
                  + "; ".join(st.reasons) + "), so persist() and save/load are refused, and an env "
                  "whose worker is multi-threaded (torch) uses backend 'pickle' where that is exact, "
                  "else is refused at start-up. Run `gym-fork doctor` for details.")
        return CriuBackend(**opts, allow_fork_only=True)
    if private_network:
        raise BackendUnavailableError(
            "private_network=True needs CRIU as root (each env worker and each restored copy gets a network "
            "namespace of its own), and CRIU is not usable here: " + "; ".join(st.reasons))
    _announce("auto-pickle", logging.WARNING,
              "gym_fork: CRIU is not usable (" + "; ".join(st.reasons) + "); using backend 'pickle', "
              "which refuses envs it cannot copy exactly. Run `gym-fork doctor` for details.")
    return PickleBackend()


def start_env(be: Backend, source: EnvSource) -> tuple[Backend, Handle, dict]:
    """Start an env on ``be``: ``(backend, handle, meta)``.

    ``backend="auto"`` in fork-only mode (non-root, no user namespaces, so no CRIU) cannot snapshot
    a worker that is unsafe to fork (several threads, or torch loaded: its meta says so).  Such an
    env goes to the pickle backend when it is not an EzPickle env and pickles exactly (the pickle
    backend's checks, run now); otherwise it is refused here, at start-up, not at its first snapshot.

    Raises:
        BackendUnavailableError: neither fork snapshots nor the pickle backend can capture the env.
    """
    handle, meta = be.start(source)
    unsafe = meta.get("threads", 1) > 1 or meta.get("torch_loaded")
    if getattr(be, "mode", None) != "fork" or not unsafe:
        return be, handle, meta
    spec = meta.get("spec")
    name = getattr(spec, "id", None) or meta.get("unwrapped_type", "this env")
    why = (f"its worker has {meta.get('threads')} threads{' and torch loaded' if meta.get('torch_loaded') else ''}, "
           "so copy-on-write fork() snapshots are unsafe, and CRIU is unavailable for this user")
    handle.kill()
    pb = PickleBackend()
    try:
        if meta.get("ezpickle"):
            raise GymForkError("it is a gymnasium EzPickle env, whose pickle holds only its constructor "
                               "arguments")
        phandle, pmeta = pb.start(source)
        try:
            pb.check_exact(phandle)
        except BaseException:
            phandle.kill()
            raise
    except GymForkError as e:
        st = criu_status()
        fix = list(getattr(st.userns, "admin_fix", None) or []) or ["allow unprivileged user namespaces"]
        raise BackendUnavailableError(
            f"gym_fork cannot snapshot env {name}: {why}; and the pickle backend cannot copy it exactly "
            f"({e}). To snapshot it, an administrator can enable unprivileged user namespaces, so that "
            f"CRIU runs for this user: {'; '.join(fix)}. Or run as root. (`gym-fork doctor` says more.)"
        ) from None
    _announce(f"auto-pickle-fallback:{name}", logging.WARNING,
              f"gym_fork: env {name}: using backend 'pickle' (checked exact: not EzPickle, a pickled copy "
              f"equals the original), because {why} ({'; '.join(criu_status().reasons)})")
    return pb, phandle, pmeta
