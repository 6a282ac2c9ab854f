"""The examples in the public API's docstrings run, and print what they say they print.

Every module of gym_fork whose docstrings hold an example (``>>>``) is listed here, so an
example cannot silently stop running: a module that gains one must be added
(``test_every_module_with_examples_is_listed``). Examples that need a second node are marked
``# doctest: +SKIP`` in their docstring and listed in ``ONLY_SKIPPED``.
"""

from __future__ import annotations

import doctest
import importlib
import pathlib
import re

import pytest

import gym_fork

# Modules whose examples run (at least one example each).
MODULES = [
    "gym_fork.snapshots.private_dirs",
    "gym_fork.snapshots.snapshot",
    "gym_fork",
    "gym_fork.env",
    "gym_fork.exploration",
    "gym_fork.vec_env",
    "gym_fork.sb3.exploration",
    "gym_fork.migration.targets",
    "gym_fork.vector",
    "gym_fork.worker.resources",
    "gym_fork.worker.prefault",
    "gym_fork.worker.files",
    "gym_fork.worker.ring",
    "gym_fork.worker.ring_slots",
    "gym_fork.worker.channel",
    "gym_fork.backends.treecapture",
    "gym_fork.backends.exactness",
    "gym_fork.backends.rng_watch",
    "gym_fork.snapshots.tree_stat",
    "gym_fork.wrapped",
    "gym_fork.check",
    "gym_fork.costs",
    "gym_fork.interrupts",
    "gym_fork.atfork",
    "gym_fork.testing.interrupts",
    "gym_fork.testing.campaigns",
]
# Modules whose examples are all marked +SKIP, and why.
ONLY_SKIPPED = {
    "gym_fork.migration.live": "moves an env to another node's agent",
    "gym_fork.backends.netns": "creates a network namespace (root)",
}

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
_EXAMPLE = re.compile(r"^\s*>>> ", re.M)


def _modules_with_examples() -> set[str]:
    root = pathlib.Path(gym_fork.__file__).parent
    found = set()
    for path in root.rglob("*.py"):
        if _EXAMPLE.search(path.read_text()):
            rel = path.relative_to(root.parent).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            found.add(".".join(parts))
    return found


@pytest.mark.parametrize("name", MODULES)
def test_examples_run(name):
    mod = importlib.import_module(name)
    res = doctest.testmod(mod, optionflags=FLAGS, verbose=False, report=True)
    assert res.attempted > 0, f"{name} is listed as having examples but none ran (docstring not found?)"
    assert res.failed == 0, f"{res.failed} of {res.attempted} examples in {name} failed (see the output above)"


@pytest.mark.parametrize("name", sorted(ONLY_SKIPPED))
def test_skipped_examples_still_parse(name):
    mod = importlib.import_module(name)
    res = doctest.testmod(mod, optionflags=FLAGS, verbose=False, report=True)
    assert res.failed == 0


def test_every_module_with_examples_is_listed():
    found = _modules_with_examples()
    unlisted = found - set(MODULES) - set(ONLY_SKIPPED)
    assert not unlisted, f"modules with examples that the suite does not run: {sorted(unlisted)}; add them to MODULES"
    gone = (set(MODULES) | set(ONLY_SKIPPED)) - found
    assert not gone, f"listed modules without examples any more: {sorted(gone)}"
