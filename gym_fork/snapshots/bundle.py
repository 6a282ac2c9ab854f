"""The bundle format: a snapshot as a self-contained, signed directory (``Snapshot.save(path)``).

A bundle is a directory (mode 0700)::

    bundle.json    format, backend, snapshot metadata, env id, the facts a restore depends on
                   (the backend adds its own, e.g. CRIU's version and the files the process
                   maps), an HMAC-SHA256 (key: :mod:`gym_fork.keys`) over all of it
    <payload>      what the backend writes (CRIU: ``images/`` with a sha256 manifest; pickle:
                   ``payload.pkl``), listed with sizes and digests in bundle.json
    workspace/     the env's workspace files at the snapshot moment, listed (size, sha256, mode)
                   in bundle.json (:mod:`gym_fork.snapshots.workspace`)

It is written aside and renamed into place (files fsynced first), so a crash leaves either the
complete bundle or none.  Nothing in a bundle is used before its HMAC verifies.  This module
knows the format only; each backend writes and reads its own payload, and
:func:`gym_fork.load_snapshot` picks the backend that a bundle names.
"""

from __future__ import annotations

import hmac
import json
import os
import platform
import shutil
import sys
import time
from typing import Any

from gym_fork import keys
from gym_fork.errors import BundleError, SnapshotCorruptedError
from gym_fork.snapshots import files, sessiondir, workspace

FORMAT = 1
META = "bundle.json"


def canonical_meta(meta: dict) -> bytes:
    """The bytes a bundle's HMAC covers: its metadata without ``hmac``, as sorted JSON."""
    return json.dumps({k: v for k, v in meta.items() if k != "hmac"}, sort_keys=True).encode()


def sign_meta(meta: dict, key: bytes | None = None) -> dict:
    """Set ``meta["hmac"]`` (``key``: this machine's, see :mod:`gym_fork.keys`); returns ``meta``."""
    meta["hmac"] = keys.sign(canonical_meta(meta), key)
    return meta


def _json_actions(actions: list | None) -> list | None:
    if actions is None:
        return None
    try:
        out = [a.tolist() if hasattr(a, "tolist") else a for a in actions]
        json.dumps(out)
        return out
    except (TypeError, ValueError):
        return None


def bundle_meta(snap: Any = None, **fields: Any) -> dict[str, Any]:
    """The unsigned metadata of a bundle (``bundle.json`` minus ``hmac``, see :func:`sign_meta`).

    Args:
        snap: the :class:`~gym_fork.Snapshot` it holds (its id, backend, steps, parent, env id,
            actions); ``None`` for checkpoints that are no snapshot (a whole job).
        **fields: what the payload adds (its backend's fields, ``images``, ``session``, ...).

    Returns:
        A new dict: the format, when it was saved, this machine's Python, kernel and
        architecture, the snapshot's fields, then ``fields``.
    """
    meta: dict[str, Any] = {"format": FORMAT}
    if snap is not None:
        meta.update(backend=snap.backend, id=snap.id, steps=snap.steps, parent_id=snap.parent_id,
                    created=snap.created, env_id=snap.env_id, actions=_json_actions(snap.actions))
    meta.update(saved=time.time(), python=sys.executable, python_version=platform.python_version(),
                kernel=platform.release(), machine=platform.machine())
    meta.update(fields)
    return meta


def save_snapshot(snap: Any, path: str, *, key: bytes | None = None) -> str:
    """Write ``snap`` as a self-contained bundle at ``path`` (which must not exist); returns the
    absolute path.  The snapshot's backend writes its payload (``bundle_write``)."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        raise FileExistsError(f"{path} exists; choose a new path or remove it first")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = sessiondir.private_mkdir(f"{path}.tmp-{os.getpid()}-{os.urandom(3).hex()}")
    try:
        with snap._open_payload() as payload:  # a stored snapshot's images, reassembled
            fields = snap._backend.bundle_write(payload, tmp)
        meta = bundle_meta(snap, **fields)
        if snap.workspace is not None:  # the env's files at the snapshot moment
            meta["workspace"] = workspace.pack(snap.workspace, os.path.join(tmp, "workspace"))
            meta["workspace_path"] = snap.workspace_path
        sign_meta(meta, key)
        with open(os.path.join(tmp, META), "w") as f:
            json.dump(meta, f, indent=1)
        for root, _dirs, names in os.walk(tmp):
            for name in names:
                if not os.path.islink(os.path.join(root, name)):  # chmod would follow the link
                    os.chmod(os.path.join(root, name), 0o600)
        files.fsync_tree(tmp)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def read_bundle_meta(path: str, *, key: bytes | None = None, require_hmac: bool = True) -> dict:
    """The metadata of the bundle at ``path``, its format and HMAC checked.

    Raises:
        BundleError: not a bundle, an unknown format, or the HMAC does not verify with ``key``.
        SnapshotCorruptedError: ``bundle.json`` is not valid JSON.
    """
    try:
        with open(os.path.join(path, META)) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise BundleError(f"{path} is not a gym_fork bundle (no {META})") from None
    except ValueError as e:
        raise SnapshotCorruptedError(f"{path}/{META} is corrupted: {e}") from e
    if meta.get("format") != FORMAT:
        raise BundleError(f"{path}: bundle format {meta.get('format')} is not supported (this gym_fork reads {FORMAT})")
    if require_hmac and not keys.verify(canonical_meta(meta), meta.get("hmac", ""), key):
        raise BundleError(
            f"{path}: the bundle's HMAC does not verify with this machine's key "
            f"({keys.key_file()} or $GYM_FORK_KEY): it was saved with another key or altered. "
            "Nothing was loaded."
        )
    return meta


def check_session(meta: dict, session: str | None, path: str) -> None:
    """A bundle streamed for one connection carries its nonce in the signed ``session`` field;
    refuse it anywhere else (a replay).  ``session=None``: nothing to check."""
    if session is not None and not hmac.compare_digest(str(meta.get("session", "")), session):
        raise BundleError(f"{path}: the bundle was signed for another session (replayed?); nothing was loaded")
