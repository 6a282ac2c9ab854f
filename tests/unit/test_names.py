"""Name validation: snapshot ids become directory names (session dirs, store entries), so an id
that is not a plain name must be refused before any path is built from it."""

from __future__ import annotations

import pytest

from gym_fork.snapshots.sessiondir import check_id


@pytest.mark.parametrize("snap_id", ["a", "A-b_9", "0" * 64, "snap-300", "_", "-"])
def test_plain_ids_pass_unchanged(snap_id):
    assert check_id(snap_id) == snap_id


@pytest.mark.parametrize("snap_id", [
    "",                 # empty
    "0" * 65,           # too long for a portable dir name component budget
    "..",
    ".",
    "../../etc",        # traversal
    "a/b",
    "/abs",
    "a\\b",
    "a.b",              # no dots at all (no hidden files, no '..')
    "a b",
    "a\n",              # a trailing newline ('$' alone would accept it)
    "\na",
    "a\x00b",
    "é",                # letters outside ASCII
    "ａ",               # full-width letter
    "a:b",
    "~",
])
def test_other_ids_refused(snap_id):
    with pytest.raises(ValueError, match="invalid snapshot id"):
        check_id(snap_id)
