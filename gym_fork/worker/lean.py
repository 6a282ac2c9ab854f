"""Keep learner-side libraries out of the worker when the env only needs a small part of them.

The common Stable-Baselines3 idiom ``make_vec_env(id, vec_env_cls=...)`` wraps every env in
SB3's ``Monitor``.  ``Monitor`` itself needs only Gymnasium, but importing
``stable_baselines3.common.monitor`` first runs ``stable_baselines3/__init__.py``, which imports
every algorithm and with them torch (seconds of start-up and a hundred MB or more per worker).
SB3's env helpers (``_patch_env``) sit likewise under ``stable_baselines3.common.vec_env``, whose
``__init__`` imports the VecEnv wrappers and torch.

In the worker, :func:`install` makes those package ``__init__`` modules *lazy*: importing a
submodule (``stable_baselines3.common.monitor``) runs only that submodule's code, exactly as
written; the package's own ``__init__`` runs, in full, the first time something reads an
attribute it defines (``stable_baselines3.PPO``, ``stable_baselines3.__version__``).  An env that
really uses torch therefore still gets it; one that only needs ``Monitor`` does not.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

# Packages whose __init__ imports far more than their submodules need: torch (SB3), and pygame
# with its ~40 shared libraries (gymnasium's box2d package imports car_racing, which imports pygame;
# LunarLander and BipedalWalker import pygame only to render). Every fork copies a process's
# mappings, and pygame's are half of a LunarLander worker's.
LAZY_PACKAGES = ("stable_baselines3", "stable_baselines3.common.vec_env", "gymnasium.envs.box2d")
# Module attributes Python's import machinery and introspection probe for; they never load the
# package (the real ones are set when the module is created).
_PROBES = frozenset({"__path__", "__file__", "__spec__", "__loader__", "__package__", "__name__", "__cached__",
                     "__builtins__", "__wrapped__", "__getattr__", "__dir__", "__origin__", "__class_getitem__"})


class _LazyPackage(types.ModuleType):
    """A package whose ``__init__`` has not run yet: it runs on the first attribute it lacks."""

    def __getattr__(self, name: str) -> Any:
        if name in _PROBES:
            raise AttributeError(name)
        _load(self)
        return getattr(self, name)


def _load(module: types.ModuleType) -> None:
    loader = module.__dict__.pop("_gym_fork_real_loader", None)
    module.__class__ = types.ModuleType
    if loader is None:
        raise AttributeError(f"module {module.__name__!r} could not be loaded")
    module.__loader__ = loader
    if module.__spec__ is not None:
        module.__spec__.loader = loader
    loader.exec_module(module)


class _DeferInit(importlib.abc.Loader):
    """Creates the package module (``__path__`` and all) but leaves its ``__init__`` for later."""

    def __init__(self, real: importlib.abc.Loader):
        self.real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.real.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__dict__["_gym_fork_real_loader"] = self.real
        module.__class__ = _LazyPackage


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in LAZY_PACKAGES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or spec.submodule_search_locations is None:
            return None
        spec.loader = _DeferInit(spec.loader)
        return spec


def install() -> None:
    """Make :data:`LAZY_PACKAGES` lazy in this process (the worker; never the learner)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
