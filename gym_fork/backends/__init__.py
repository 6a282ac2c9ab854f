"""Snapshot backends and their registry: a backend name -> a factory of :class:`Backend` objects.

``criu`` (process checkpoints, :mod:`~gym_fork.backends.criu`) and ``pickle`` (in-process
cloudpickle, :mod:`~gym_fork.backends.pickle`) are registered here; ``auto`` picks one for this
machine (:mod:`~gym_fork.backends.auto`).  The registry also tells the data layer which backend
a saved snapshot names (:func:`bundle_backend`), so bundles and stores never import a backend.
"""

from __future__ import annotations

from typing import Any, Callable

from gym_fork.backends import auto
from gym_fork.backends.base import Backend
from gym_fork.backends.criu import CriuBackend
from gym_fork.backends.pickle import PickleBackend
from gym_fork.errors import BackendUnavailableError, BundleError
from gym_fork.snapshots.snapshot import set_backend_resolver

_FACTORIES: dict[str, Callable[..., Backend]] = {}


def register(name: str, factory: Callable[..., Backend]) -> None:
    """Make ``backend=name`` mean ``factory(verify=..., worker_log=..., fork_tier=...)`` (a factory
    may ignore options it has no use for)."""
    _FACTORIES[name] = factory


def names() -> tuple[str, ...]:
    """The backend names ``get_backend`` accepts, ``"auto"`` first."""
    return ("auto", *_FACTORIES)


def get_backend(name: str | Backend = "auto", *, verify: str = "full", worker_log: str | None = None,
                fork_tier: bool | str = "auto", private_network: bool = False) -> Backend:
    """A backend object for ``name`` (``"auto"``: see :mod:`gym_fork.backends.auto`); a Backend
    passes through unchanged.

    Raises:
        ValueError: an unknown name.
        BackendUnavailableError: the backend cannot work here (e.g. ``"criu"`` without CRIU).
    """
    if isinstance(name, Backend):
        return name
    if name == "auto":
        return auto.choose(verify=verify, worker_log=worker_log, fork_tier=fork_tier, private_network=private_network)
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(names())}")
    if private_network:
        return factory(verify=verify, worker_log=worker_log, fork_tier=fork_tier, private_network=True)
    return factory(verify=verify, worker_log=worker_log, fork_tier=fork_tier)


def bundle_backend(name: Any) -> Backend:
    """The backend that reads snapshots saved by backend ``name`` (a bundle's or store entry's
    ``backend`` field), with default options.

    Raises:
        BundleError: no such backend, or it cannot work here (e.g. no usable CRIU).
    """
    if not isinstance(name, str) or name not in _FACTORIES:
        raise BundleError(f"unknown backend {name!r} (this gym_fork has {', '.join(_FACTORIES)})")
    try:
        return _FACTORIES[name]()
    except BackendUnavailableError as e:
        raise BundleError(f"a {name!r} snapshot cannot be restored here: {e}") from None


register("criu", lambda verify="full", worker_log=None, fork_tier="auto", private_network=False: CriuBackend(
    verify=verify, worker_log=worker_log, fork_tier=fork_tier, private_network=private_network))


def _pickle(private_network: bool = False, **_options: Any) -> Backend:
    if private_network:
        raise BackendUnavailableError("private_network=True needs backend 'criu' (as root): the pickle backend "
                                      "runs the env in this process")
    return PickleBackend()


register("pickle", _pickle)
set_backend_resolver(bundle_backend)
