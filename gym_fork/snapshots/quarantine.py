"""Damaged store entries: moved aside, listed with the reason, never silently deleted.

An entry ``DIR/snaps/<id>/`` whose ``bundle.json`` or ``recipe.json`` is unreadable, not JSON, or
has fields of the wrong type cannot be used, but it may still hold someone's data (or evidence of
tampering).  It is renamed to ``DIR/quarantine/<id>-<time>/`` (one step: the store never sees a
half-moved entry), a ``QUARANTINE.json`` beside its files says why and when, the move is logged,
and ``gym-fork snapshots ls`` lists it.  Its chunks stay referenced, so ``gc`` keeps them.  Only
``gym-fork snapshots gc DIR --drop-quarantined`` deletes quarantined entries, and says so.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

from gym_fork.snapshots import sessiondir
from gym_fork.snapshots.files import atomic_write_json, read_bounded

QUARANTINE = "quarantine"
REASON = "QUARANTINE.json"
log = logging.getLogger("gym_fork")


def quarantine_dir(root: str) -> str:
    return os.path.join(root, QUARANTINE)


def move(root: str, snap_id: str, reason: str) -> str | None:
    """Move the entry ``snap_id`` of the store at ``root`` into quarantine; returns where it went
    (None when it was gone already).  Call with the store's lock held."""
    src = os.path.join(root, "snaps", sessiondir.check_id(snap_id))
    qdir = sessiondir.private_mkdir(quarantine_dir(root))
    dest = os.path.join(qdir, f"{snap_id}-{time.strftime('%Y%m%dT%H%M%S')}-{os.urandom(2).hex()}")
    try:
        os.rename(src, dest)
    except FileNotFoundError:
        return None
    try:
        # rename over whatever is there (a link included): never writes through one
        atomic_write_json(os.path.join(dest, REASON), {"id": snap_id, "reason": reason, "time": time.time()})
    except OSError as e:  # the move is what matters; the listing then says "reason unknown"
        log.warning("gym_fork: could not record why %s was quarantined: %s", dest, e)
    log.warning("gym_fork: snapshot %s in %s is damaged (%s); moved to %s (nothing deleted; "
                "`gym-fork snapshots ls %s` lists it)", snap_id, root, reason, dest, root)
    return dest


def entries(root: str) -> list[dict]:
    """The quarantined entries: ``{"id", "path", "reason", "time"}``, oldest first."""
    qdir = quarantine_dir(root)
    try:
        names = sorted(os.listdir(qdir))
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        path = os.path.join(qdir, name)
        info: dict = {"id": name.rsplit("-", 2)[0], "path": path, "reason": "reason unknown", "time": None}
        try:
            rec = json.loads(read_bounded(os.path.join(path, REASON), 1 << 20))
            if isinstance(rec, dict):
                info.update({k: rec[k] for k in ("reason", "time") if isinstance(rec.get(k), (str, float, int))})
        except Exception:  # noqa: BLE001 - a listing never fails on a bad record
            pass
        out.append(info)
    return out


def recipe_paths(root: str) -> list[str]:
    """The ``recipe.json`` of every quarantined entry (their chunks are kept)."""
    return [os.path.join(e["path"], "recipe.json") for e in entries(root)]


def drop_all(root: str) -> list[dict]:
    """Delete every quarantined entry; returns what was deleted.  Call with the store's lock held."""
    gone = entries(root)
    for e in gone:
        shutil.rmtree(e["path"], ignore_errors=True)
        log.warning("gym_fork: deleted the quarantined snapshot entry %s (%s)", e["path"], e["reason"])
    return gone
