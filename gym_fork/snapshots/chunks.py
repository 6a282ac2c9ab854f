"""Content-addressed chunk files: ``DIR/ab/<sha256>``, shared by every snapshot of a store.

Consecutive snapshots of one env share most of their memory pages, so a store keeps page images
as lists of chunks (a *recipe*) and writes only chunks it does not have yet.  A chunk is written
aside and renamed to its digest, so a visible chunk is always complete; nothing here fsyncs
(the store flushes the file system once per snapshot).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterable

from gym_fork.errors import SnapshotCorruptedError
from gym_fork.snapshots import sessiondir
from gym_fork.snapshots.files import allocated_bytes


class ChunkFiles:
    """The chunk directory of one store.

    Args:
        root: the directory (created 0700).
    """

    def __init__(self, root: str):
        self.root = sessiondir.private_mkdir(root)

    def path(self, digest: str) -> str:
        return os.path.join(self.root, digest[:2], digest)

    def put(self, src: str, lengths: Iterable[int]) -> list[str]:
        """Cut ``src`` into consecutive pieces of ``lengths`` bytes and store each one by its
        sha256 (unless already there); returns the digests, in order."""
        out = []
        with open(src, "rb") as f:
            for n in lengths:
                data = f.read(n)
                if not data:
                    break
                digest = hashlib.sha256(data).hexdigest()
                final = self.path(digest)
                if not os.path.exists(final):
                    d = os.path.dirname(final)
                    if not os.path.isdir(d):
                        sessiondir.private_mkdir(d)
                    tmp = f"{final}.tmp-{os.getpid()}"
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                    with os.fdopen(fd, "wb") as cf:
                        cf.write(data)
                    os.rename(tmp, final)  # a visible chunk is always complete
                out.append(digest)
        return out

    def read(self, digest: str, *, verify: bool, what: str) -> bytes:
        """A chunk's bytes (``verify``: checked against its digest).

        Raises:
            SnapshotCorruptedError: the chunk is missing or (``verify``) corrupted; ``what`` names
                the snapshot in the message.
        """
        try:
            with open(self.path(digest), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise SnapshotCorruptedError(f"{what}: chunk {digest} is missing") from None
        if verify and hashlib.sha256(data).hexdigest() != digest:
            raise SnapshotCorruptedError(f"{what}: chunk {digest} fails its sha256 check")
        return data

    def disk_bytes(self, digest: str) -> int:
        return allocated_bytes(self.path(digest))

    def drop_unreferenced(self, refs: dict[str, int]) -> None:
        """Delete the chunks whose reference count in ``refs`` is zero or less."""
        for c, n in refs.items():
            if n <= 0:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path(c))

    def sweep(self, referenced: Iterable[str]) -> int:
        """Delete every chunk not in ``referenced`` and every half-written one; returns how many."""
        keep = set(referenced)
        removed = 0
        for sub in os.listdir(self.root):
            for name in os.listdir(os.path.join(self.root, sub)):
                if ".tmp-" in name or name not in keep:
                    os.unlink(os.path.join(self.root, sub, name))
                    removed += 1
        return removed


def count_refs(recipes: Iterable[dict]) -> dict[str, int]:
    """How many times each chunk is used by ``recipes`` (``{"files": {name: {"chunks": [...]}}}``)."""
    refs: dict[str, int] = {}
    for recipe in recipes:
        for entry in recipe["files"].values():
            for c in entry["chunks"]:
                refs[c] = refs.get(c, 0) + 1
    return refs
