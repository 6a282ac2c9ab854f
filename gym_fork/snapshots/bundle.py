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
complete bundle or none.  Nothing in a bundle is used before its HMAC verifies, and then only
through the signed list: ``bundle.json`` is read bounded and without following links, its
fields are type-checked (:func:`check_meta`), and the payload files are opened only if that list
names them, copied into a private directory and checked there (the bytes restored are the bytes
checked; see :func:`gym_fork.snapshots.sessiondir.copy_verified`).  This module
knows the format only; each backend writes and reads its own payload, and
:func:`gym_fork.load_snapshot` picks the backend that a bundle names.
"""

from __future__ import annotations

import hmac
import json
import os
import platform
import re
import shutil
import sys
import time
from typing import Any

from gym_fork import keys
from gym_fork.errors import BundleDamagedError, BundleError, SnapshotCorruptedError
from gym_fork.snapshots import files, private_dirs, sessiondir, workspace
from gym_fork.snapshots.files import as_no_space, read_bounded

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
    absolute path.  The snapshot's backend writes its payload (``bundle_write``).

    Raises:
        FileExistsError: ``path`` exists.
        NoSpaceError: the disk filled up; nothing is left at ``path`` and the snapshot is unchanged.
    """
    path = os.path.abspath(path)
    if os.path.exists(path):
        raise FileExistsError(f"{path} exists; choose a new path or remove it first")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}-{os.urandom(3).hex()}"
    try:
        # made inside the try: Ctrl-C right after the directory was made (still in private_mkdir)
        # left it behind
        sessiondir.private_mkdir(tmp)
        with snap._open_payload() as payload:  # a stored snapshot's images, reassembled
            fields = snap._backend.bundle_write(payload, tmp)
        meta = bundle_meta(snap, **fields)
        if snap.workspace is not None:  # the env's files at the snapshot moment
            meta["workspace"] = workspace.pack(snap.workspace, os.path.join(tmp, "workspace"), times=True)
            meta["workspace_path"] = snap.workspace_path
            if getattr(snap, "workspace_aliases", ()):
                meta["workspace_aliases"] = list(snap.workspace_aliases)
        if getattr(snap, "private_dirs", None):  # the env's private directories at the snapshot moment
            meta["private_dirs"] = private_dirs.pack(snap, os.path.join(tmp, "private_dirs"))
        sign_meta(meta, key)
        with open(os.path.join(tmp, META), "w") as f:
            json.dump(meta, f, indent=1)
        for root, _dirs, names in os.walk(tmp):
            for name in names:
                if not os.path.islink(os.path.join(root, name)):  # chmod would follow the link
                    os.chmod(os.path.join(root, name), 0o600)
        files.fsync_tree(tmp)
        os.rename(tmp, path)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        full = as_no_space(e, os.path.dirname(path), f"the bundle {path}", getattr(snap, "size_bytes", None) or None)
        if full is not None and full is not e:
            raise full from e
        raise
    return path


META_LIMIT = 64 << 20  # bundle.json is read whole before its HMAC is checked: bounded
_HEX64 = re.compile(r"[0-9a-f]{64}")
_NUM = (int, float)
# the fields every snapshot bundle has, and their JSON types (bool is no int here)
_COMMON: dict[str, tuple] = {
    "format": (int,), "backend": (str,), "id": (str,), "steps": (int,), "parent_id": (str, type(None)),
    "created": _NUM, "env_id": (str, type(None)), "actions": (list, type(None)), "saved": _NUM,
    "python": (str,), "python_version": (str,), "kernel": (str,), "machine": (str,),
}
_OPTIONAL: dict[str, tuple] = {"workspace": (dict,), "workspace_path": (str, type(None)), "session": (str,),
                               "private_dirs": (list,), "workspace_aliases": (list,)}


def _type_names(types: tuple) -> str:
    return " or ".join("null" if t is type(None) else {"int": "integer", "float": "number", "str": "string",
                                                        "list": "list", "dict": "object"}.get(t.__name__, t.__name__)
                       for t in types)


def check_field(meta: dict, name: str, types: tuple, path: str, *, optional: bool = False) -> Any:
    """``meta[name]``, which must have one of the JSON ``types`` (``bool`` never passes as a
    number); raises BundleDamagedError naming the field otherwise.  ``optional``: absent is fine
    (returns None)."""
    if name not in meta:
        if optional:
            return None
        raise BundleDamagedError(f"{path}: {META} has no field {name!r} (damaged); nothing was loaded")
    v = meta[name]
    if isinstance(v, bool) and bool not in types or not isinstance(v, types):
        raise BundleDamagedError(f"{path}: {META} field {name!r} is a {type(v).__name__}, not a {_type_names(types)} "
                                 "(damaged or altered); nothing was loaded")
    return v


def check_images(images: Any, path: str, field: str = "images") -> dict:
    """A signed image list (``{name: {"size": int >= 0, "sha256": 64 hex}}``; a streamed one may
    carry ``blake3`` instead; names are plain file names) checked; raises BundleDamagedError
    otherwise."""
    if not isinstance(images, dict):
        raise BundleDamagedError(f"{path}: {META} field {field!r} is not an object; nothing was loaded")
    for name, e in images.items():
        ok = (sessiondir.is_image_file_name(name) and isinstance(e, dict)
              and isinstance(e.get("size"), int) and not isinstance(e.get("size"), bool)
              and e["size"] >= 0 and any(isinstance(e.get(alg), str) and _HEX64.fullmatch(e[alg])
                                         for alg in ("sha256", "blake3")))
        if not ok:
            raise BundleDamagedError(f"{path}: {META} entry {field}[{name!r}] is not {{size, sha256}}; nothing "
                                     "was loaded")
    return images


def check_meta(meta: Any, path: str) -> dict:
    """``meta`` unchanged if it has the shape of a snapshot bundle's metadata: every common field
    present with its type (the backend's own fields are checked by its ``check_compatible``).
    Raises BundleDamagedError naming the first wrong field."""
    if not isinstance(meta, dict):
        raise BundleDamagedError(f"{path}: {META} holds a JSON {type(meta).__name__}, not an object (damaged); "
                                 "nothing was loaded")
    for name, types in _COMMON.items():
        check_field(meta, name, types, path)
    for name, types in _OPTIONAL.items():
        check_field(meta, name, types, path, optional=True)
    if not sessiondir.is_valid_id(meta["id"]) or meta["steps"] < 0:
        raise BundleDamagedError(f"{path}: {META} has an invalid id or step count; nothing was loaded")
    return meta


def read_bundle_meta(path: str, *, key: bytes | None = None, require_hmac: bool = True) -> dict:
    """The metadata of the bundle (or store entry) at ``path``: read without following a link
    or blocking and at most :data:`META_LIMIT` bytes, its format and HMAC checked, then every
    common field's type.

    Raises:
        BundleError: not a bundle (a file, nothing there, no bundle.json), an unknown format, or
            the HMAC does not verify with ``key``.
        BundleDamagedError: ``bundle.json`` is not a regular file, not JSON, not an object, or a
            field has the wrong type (also a :class:`SnapshotCorruptedError`).
    """
    if not os.path.isdir(path):
        if os.path.lexists(path):
            raise BundleError(f"{path} is a file, not a bundle directory (Snapshot.save(path) writes a directory)")
        raise BundleError(f"{path}: no such bundle directory")
    try:
        raw = read_bounded(os.path.join(path, META), META_LIMIT)
    except SnapshotCorruptedError as e:
        if not os.path.lexists(os.path.join(path, META)):
            raise BundleError(f"{path} is not a gym_fork bundle (no {META})") from None
        raise BundleDamagedError(str(e)) from None
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise BundleDamagedError(f"{path}/{META} is corrupted (not JSON: {e}); nothing was loaded") from None
    if not isinstance(meta, dict):
        check_meta(meta, path)  # raises: not an object
    if meta.get("format") != FORMAT or isinstance(meta.get("format"), bool):
        raise BundleError(f"{path}: bundle format {meta.get('format')!r} is not supported "
                          f"(this gym_fork reads {FORMAT})")
    if require_hmac:
        mac = meta.get("hmac")
        if not isinstance(mac, str) or not _HEX64.fullmatch(mac):
            raise BundleDamagedError(f"{path}: {META} has no valid 'hmac' field (a 64-digit hex string); it was "
                                     "altered or damaged. Nothing was loaded.")
        if not keys.verify(canonical_meta(meta), mac, key):
            raise BundleError(
                f"{path}: the bundle's HMAC does not verify with this machine's key "
                f"({keys.key_file()} or $GYM_FORK_KEY): it was saved with another key or altered. "
                "Nothing was loaded."
            )
    return check_meta(meta, path)


def check_session(meta: dict, session: str | None, path: str) -> None:
    """A bundle streamed for one connection carries its nonce in the signed ``session`` field;
    refuse it anywhere else (a replay).  ``session=None``: nothing to check."""
    if session is not None and not hmac.compare_digest(str(meta.get("session", "")), session):
        raise BundleError(f"{path}: the bundle was signed for another session (replayed?); nothing was loaded")
