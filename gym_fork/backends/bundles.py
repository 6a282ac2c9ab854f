"""Reading a bundle back: :func:`load_snapshot` (the public ``gym_fork.load_snapshot``).

The bundle format is :mod:`gym_fork.snapshots.bundle`'s; the payload inside is read by the
backend the bundle names, found in the registry (:func:`gym_fork.backends.bundle_backend`).
"""

from __future__ import annotations

import os

from gym_fork.backends import bundle_backend
from gym_fork.errors import BundleError
from gym_fork.snapshots.bundle import check_session, read_bundle_meta
from gym_fork.snapshots.snapshot import Snapshot


def load_snapshot(path: str, *, key: bytes | None = None, received: dict | None = None,
                  session: str | None = None) -> Snapshot:
    """Load a bundle written by ``Snapshot.save``; restore it with ``env.restore(snap)`` (an env
    with the same env id) or ``ForkableEnv.from_snapshot(snap)``.

    Nothing is unpickled or restored before the bundle's HMAC verifies, the machine is found
    compatible (CRIU version, architecture, the files the process maps) and every payload file
    matches its signed digest.

    Args:
        path: the bundle directory.
        key: the HMAC key (default: this machine's, see :mod:`gym_fork.keys`).
        received: (live migration) the files' sizes and digests as computed while they arrived;
            they must equal the signed list exactly, and the files are not hashed again.
        session: the signed ``session`` field must equal it (a bundle streamed for another
            connection, i.e. a replay, is refused).

    Returns:
        The snapshot (its ``lineage`` is None: it restores into any env with its env id).

    Raises:
        BundleError: not a bundle, the HMAC fails, another session, an unknown backend, or it
            does not fit this machine.
        SnapshotCorruptedError: a file is missing or fails its digest.
    """
    path = os.path.abspath(path)
    meta = read_bundle_meta(path, key=key)
    check_session(meta, session, path)
    try:
        backend = bundle_backend(meta["backend"])
    except BundleError as e:
        raise BundleError(f"{path}: {e}") from None
    backend.check_compatible(meta, path)
    payload, size = backend.bundle_read(path, meta, received)
    return Snapshot._from_meta(meta, backend, payload, size, path)
