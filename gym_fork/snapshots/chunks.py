"""Content-addressed chunk files: ``DIR/ab/<sha256>``, shared by every snapshot of a store.

Consecutive snapshots of one env share most of their memory pages, so a store keeps page images
as lists of chunks (a *recipe*) and writes only chunks it does not have yet.  A chunk is written
aside and renamed to its digest, so a visible chunk is always complete; nothing here fsyncs
(the store flushes the file system once per snapshot).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Iterable
from typing import Any

from gym_fork.errors import BundleDamagedError, SnapshotCorruptedError
from gym_fork.snapshots import sessiondir
from gym_fork.snapshots.files import allocated_bytes, read_bounded

RECIPE_LIMIT = 256 << 20
_HEX64 = re.compile(r"[0-9a-f]{64}")


class ChunkFiles:
    """The chunk directory of one store.

    Args:
        root: the directory (created 0700).
    """

    def __init__(self, root: str):
        self.root = sessiondir.private_mkdir(root)

    def path(self, digest: str) -> str:
        return os.path.join(self.root, digest[:2], digest)

    def put(self, src: str, lengths: Iterable[int], created: list[str] | None = None) -> list[str]:
        """Cut ``src`` into consecutive pieces of ``lengths`` bytes and store each one by its
        sha256 (unless already there); returns the digests, in order.  ``created`` collects the
        digests of the chunks this call wrote (a failed store write removes exactly those); a
        half-written chunk is removed before the error propagates."""
        out = []
        with open(src, "rb") as f:
            for n in lengths:
                data = f.read(n)
                if not data:
                    break
                digest = hashlib.sha256(data).hexdigest()
                final = self.path(digest)
                # a chunk already there is reused only if it holds these bytes: one damaged on
                # disk was otherwise trusted by its name, and every later snapshot that shares it
                # was stored "fine" and could never be restored (a compare, not a hash: ~10 GB/s)
                held = self._holds(final, data)
                if held is not True:
                    d = os.path.dirname(final)
                    if not os.path.isdir(d):
                        sessiondir.private_mkdir(d)
                    tmp = f"{final}.tmp-{os.getpid()}"
                    try:
                        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                        with os.fdopen(fd, "wb") as cf:
                            cf.write(data)
                        os.rename(tmp, final)  # a visible chunk is always complete
                    except BaseException:
                        with contextlib.suppress(OSError):
                            os.unlink(tmp)
                        raise
                    if created is not None and held is None and digest not in created:
                        created.append(digest)  # (new; a damaged one repaired stays if this write fails)
                out.append(digest)
        return out

    @staticmethod
    def _holds(path: str, data: bytes) -> bool | None:
        """Whether the chunk file ``path`` holds exactly ``data`` (None: there is no such file)."""
        try:
            with open(path, "rb") as f:
                return f.read(len(data) + 1) == data
        except FileNotFoundError:
            return None

    def remove(self, digests: Iterable[str]) -> None:
        """Delete these chunks (those a failed write created: nothing else refers to them)."""
        for c in digests:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(c))

    def read(self, digest: str, *, verify: bool, what: str, size: int | None = None) -> bytes:
        """A chunk's bytes (``verify``: checked against its digest); a regular file, opened
        without following links or blocking, at most ``size`` bytes when given.

        Raises:
            SnapshotCorruptedError: the chunk is missing, not a regular file, too large or
                (``verify``) corrupted; ``what`` names the snapshot in the message.
        """
        data = read_bounded(self.path(digest), size if size is not None else 1 << 30, what=f"{what}: chunk")
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
            if not os.path.isdir(os.path.join(self.root, sub)) or os.path.islink(os.path.join(self.root, sub)):
                continue
            for name in os.listdir(os.path.join(self.root, sub)):
                if ".tmp-" in name or name not in keep:
                    os.unlink(os.path.join(self.root, sub, name))
                    removed += 1
        return removed


def check_recipe(recipe: Any, what: str) -> dict:
    """``recipe`` unchanged if it has a recipe's shape (``{"chunk_size": int, "files": {name:
    {"size": int, "chunks": [64 hex, ...]}}}``), else BundleDamagedError.  A recipe is not signed:
    what it reassembles is checked against the entry's signed digests."""
    ok = isinstance(recipe, dict) and isinstance(recipe.get("files"), dict)
    if ok:
        for name, e in recipe["files"].items():
            if not (isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("chunks"), list)
                    and all(isinstance(c, str) and _HEX64.fullmatch(c) for c in e["chunks"])):
                ok = False
                break
    if not ok:
        raise BundleDamagedError(f"{what}: recipe.json is malformed (damaged or altered)")
    return recipe


def read_recipe(entry_dir: str, what: str) -> dict:
    """The checked recipe of a store entry (an empty one when it has no recipe.json: nothing
    chunked).  Raises BundleDamagedError when it is not a regular file, not JSON or malformed."""
    path = os.path.join(entry_dir, "recipe.json")
    if not os.path.lexists(path):
        return {"files": {}}
    try:
        return check_recipe(json.loads(read_bounded(path, RECIPE_LIMIT, what=what)), what)
    except BundleDamagedError:
        raise
    except (SnapshotCorruptedError, ValueError, RecursionError) as e:
        raise BundleDamagedError(f"{what}: recipe.json is unreadable ({e})") from None


def count_refs(recipes: Iterable[dict]) -> dict[str, int]:
    """How many times each chunk is used by ``recipes`` (``{"files": {name: {"chunks": [...]}}}``)."""
    refs: dict[str, int] = {}
    for recipe in recipes:
        for entry in recipe["files"].values():
            for c in entry["chunks"]:
                refs[c] = refs.get(c, 0) + 1
    return refs
