"""Portable snapshot bundles: ``Snapshot.save(path)`` and :func:`load_snapshot`.

A bundle is a directory (mode 0700)::

    bundle.json    format, backend, snapshot metadata, env id, the CRIU/kernel/Python facts a
                   restore depends on, the files the process maps (path, size), an HMAC
    images/        CRIU images + MANIFEST.json (sha256 of each)      -- criu backend
    payload.pkl    the cloudpickle payload                            -- pickle backend
    workspace/     the env's workspace files at the snapshot moment   -- envs with a workspace
                   (SQLite databases as online backups); bundle.json lists every file's size,
                   sha256 and mode, so the HMAC covers them (:mod:`gym_fork.snapshots.workspace`)

It is written aside and renamed into place (files fsynced first), so a crash leaves either the
complete bundle or none.  ``bundle.json`` carries an HMAC-SHA256 (key: :mod:`gym_fork.keys`)
over its content, which includes every image's and the payload's sha256: a pickle payload is
never unpickled, and images never restored, unless that HMAC verifies.  Loading also refuses,
before anything is started, a bundle whose CRIU major version, mapped files (the Python binary,
shared libraries: CRIU needs them identical) or backend do not fit this machine.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import platform
import shutil
import sys
import time
from typing import Any

from gym_fork import keys
from gym_fork.snapshots import sessiondir
from gym_fork.errors import BundleError, SnapshotCorruptedError

FORMAT = 1


def _canonical(meta: dict) -> bytes:
    return json.dumps({k: v for k, v in meta.items() if k != "hmac"}, sort_keys=True).encode()


def _json_actions(actions: list | None) -> list | None:
    if actions is None:
        return None
    try:
        out = [a.tolist() if hasattr(a, "tolist") else a for a in actions]
        json.dumps(out)
        return out
    except (TypeError, ValueError):
        return None


def _mapped_files(images: str) -> list[list]:
    """(path, size) of every regular file the dumped process has open or mapped."""
    import pycriu

    try:
        with open(os.path.join(images, "files.img"), "rb") as f:
            entries = pycriu.images.load(f)["entries"]
    except (OSError, Exception):  # noqa: BLE001 - an unreadable image is caught by the checksums
        return []
    import stat

    return sorted([e["reg"]["name"], e["reg"].get("size", 0)] for e in entries
                  if e.get("type") == "REG" and e["reg"]["name"].startswith("/")
                  and stat.S_ISREG(e["reg"].get("mode", 0)))  # directories (cwd, root) are REG too


def _copy_tree(src: str, dst: str) -> None:
    os.makedirs(dst, mode=0o700)
    for name in os.listdir(src):
        s, d = os.path.join(src, name), os.path.join(dst, name)
        if not os.path.isfile(s):
            continue
        try:
            os.link(s, d)  # same filesystem: no copy (images are never modified in place)
        except OSError:
            shutil.copy2(s, d)


def _fsync_tree(path: str) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            if os.path.islink(os.path.join(root, name)):  # a workspace symlink: not ours to open
                continue
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        dfd = os.open(root, os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def save_snapshot(snap: Any, path: str, *, key: bytes | None = None) -> str:
    """Write ``snap`` as a self-contained bundle at ``path`` (which must not exist)."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        raise FileExistsError(f"{path} exists; choose a new path or remove it first")
    payload = snap.payload()
    meta: dict[str, Any] = {
        "format": FORMAT, "backend": snap.backend, "id": snap.id, "steps": snap.steps,
        "parent_id": snap.parent_id, "created": snap.created, "saved": time.time(),
        "env_id": snap.env_id, "actions": _json_actions(snap.actions),
        "python": sys.executable, "python_version": platform.python_version(),
        "kernel": platform.release(), "machine": platform.machine(),
    }
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = sessiondir.private_mkdir(f"{path}.tmp-{os.getpid()}-{os.urandom(3).hex()}")
    try:
        if snap.backend == "criu":
            from gym_fork.criu.status import criu_status

            payload = snap._backend.persist(payload)
            image = getattr(payload, "image", None) or payload
            _copy_tree(image.path, os.path.join(tmp, "images"))
            man = sessiondir.verify(os.path.join(tmp, "images"), full=True)  # copy is intact
            st = criu_status()
            meta.update(criu_version=st.version, ino=image.ino, fork_tier=image.fork_tier,
                        images=man["files"], files=_mapped_files(os.path.join(tmp, "images")))
        elif snap.backend == "pickle":
            with open(os.path.join(tmp, "payload.pkl"), "wb") as f:
                f.write(payload)
            meta["payload_sha256"] = hashlib.sha256(payload).hexdigest()
        else:
            raise BundleError(f"backend {snap.backend!r} cannot be saved as a bundle")
        if snap.workspace is not None:  # the env's files at the snapshot moment
            from gym_fork.snapshots.workspace import pack

            meta["workspace"] = pack(snap.workspace, os.path.join(tmp, "workspace"))
            meta["workspace_path"] = snap.workspace_path
        meta["hmac"] = keys.sign(_canonical(meta), key)
        with open(os.path.join(tmp, "bundle.json"), "w") as f:
            json.dump(meta, f, indent=1)
        for root, dirs, files in os.walk(tmp):
            for name in files:
                if not os.path.islink(os.path.join(root, name)):  # chmod would follow the link
                    os.chmod(os.path.join(root, name), 0o600)
        _fsync_tree(tmp)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def read_bundle_meta(path: str, *, key: bytes | None = None, require_hmac: bool = True) -> dict:
    try:
        with open(os.path.join(path, "bundle.json")) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise BundleError(f"{path} is not a gym_fork bundle (no bundle.json)") from None
    except ValueError as e:
        raise SnapshotCorruptedError(f"{path}/bundle.json is corrupted: {e}") from e
    if meta.get("format") != FORMAT:
        raise BundleError(f"{path}: bundle format {meta.get('format')} is not supported (this gym_fork reads {FORMAT})")
    if require_hmac and not keys.verify(_canonical(meta), meta.get("hmac", ""), key):
        raise BundleError(
            f"{path}: the bundle's HMAC does not verify with this machine's key "
            f"({keys.key_file()} or $GYM_FORK_KEY): it was saved with another key or altered. "
            "Nothing was loaded."
        )
    return meta


def check_compatible(meta: dict, path: str) -> None:
    """Refuse, with the reason, a CRIU bundle this machine cannot restore."""
    from gym_fork.criu.status import criu_status

    st = criu_status()
    if not st.usable:
        raise BundleError(f"{path}: a CRIU bundle needs CRIU here, but: " + "; ".join(st.reasons))
    theirs, ours = str(meta.get("criu_version", "?")), str(st.version)
    if theirs.split(".")[0] != ours.split(".")[0]:
        raise BundleError(f"{path}: saved with CRIU {theirs}, this machine has CRIU {ours} (major versions differ)")
    if meta.get("machine") != platform.machine():
        raise BundleError(f"{path}: saved on {meta.get('machine')}, this machine is {platform.machine()}")
    bad = []
    for fpath, size in meta.get("files", []):
        try:
            have = os.path.getsize(fpath)
        except OSError:
            bad.append(f"{fpath} is missing")
            continue
        if have != size:
            bad.append(f"{fpath} has {have} bytes, the process mapped {size}")
    if bad:
        raise BundleError(
            f"{path}: the process needs files that differ here ({'; '.join(bad[:3])}"
            f"{f'; and {len(bad) - 3} more' if len(bad) > 3 else ''}). Restore on a machine with the "
            "same Python, venv and libraries at the same paths."
        )


def load_snapshot(path: str, *, key: bytes | None = None, received: dict | None = None,
                  session: str | None = None) -> Any:
    """Load a bundle written by ``Snapshot.save``; restore it with ``env.restore(snap)`` (an env
    with the same env id) or ``ForkableEnv.from_snapshot(snap)``.

    ``received`` (live migration): the images' sizes and sha256 as computed while they arrived;
    they must equal the HMAC-covered list exactly, and the files are not hashed again.
    ``session``: the signed ``session`` field must equal it (a bundle streamed for another
    connection, i.e. a replay, is refused).

    Raises BundleError (does not fit here / HMAC fails) or SnapshotCorruptedError.
    """
    from gym_fork.backends import get_backend
    from gym_fork.snapshots.snapshot import Snapshot

    path = os.path.abspath(path)
    meta = read_bundle_meta(path, key=key)
    if session is not None and not hmac.compare_digest(str(meta.get("session", "")), session):
        raise BundleError(f"{path}: the bundle was signed for another session (replayed?); nothing was loaded")
    if meta["backend"] == "criu":
        check_compatible(meta, path)
        images = os.path.join(path, "images")
        if received is not None:
            sessiondir.verify_received(received, meta["images"], path)
            man = {"files": meta["images"]}
        else:
            man = sessiondir.verify(images, full=True)
            if man["files"] != meta["images"]:
                raise SnapshotCorruptedError(f"{path}: image manifest does not match bundle.json")
        from gym_fork.backends.criu import CriuPayload

        backend = get_backend("criu")
        payload: Any = CriuPayload(images, meta["ino"], fork_tier=meta.get("fork_tier", False), owned=False)
        size = sum(f["size"] for f in man["files"].values())
    elif meta["backend"] == "pickle":
        with open(os.path.join(path, "payload.pkl"), "rb") as f:
            payload = f.read()
        if hashlib.sha256(payload).hexdigest() != meta.get("payload_sha256"):
            raise SnapshotCorruptedError(f"{path}/payload.pkl fails its sha256 check; it was not unpickled")
        backend = get_backend("pickle")
        size = len(payload)
    else:
        raise BundleError(f"{path}: unknown backend {meta['backend']!r}")
    snap = Snapshot(backend=backend, payload=payload, size_bytes=size, steps=meta["steps"],
                    parent_id=meta.get("parent_id"), lineage=None, actions=meta.get("actions"),
                    snap_id=meta["id"], env_id=meta.get("env_id"))
    snap.created = meta.get("created", snap.created)
    snap.bundle_path = path
    from gym_fork.snapshots.workspace import adopt

    adopt(snap, os.path.join(path, "workspace"), meta.get("workspace"), meta.get("workspace_path"), path)
    return snap
