"""A store's two budgets: which in-memory snapshot to spill to disk, which stored one to delete.

* memory: the least recently used in-memory (copy-on-write) snapshots go to disk once their
  count or the memory they hold privately is over the limit.  Only weak references are kept:
  a snapshot nobody references any more is dropped (its frozen process ends), never written.
* disk: the least recently used *unpinned* stored snapshots are deleted until the store's real
  size (per-snapshot files plus every referenced chunk once) fits.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import Any


class MemoryBudget:
    """The in-memory snapshots a store tracks, least recently used first.

    Args:
        max_memory: bytes (the sum of ``Snapshot.memory_bytes()``), or None.
        max_in_memory: a number of snapshots, or None.
    """

    def __init__(self, max_memory: int | None, max_in_memory: int | None):
        self.max_memory = max_memory
        self.max_in_memory = max_in_memory
        self._live: OrderedDict[str, weakref.ref] = OrderedDict()

    def add(self, snap: Any) -> None:
        self._live[snap.id] = weakref.ref(snap)

    def touch(self, snap_id: str) -> bool:
        """Mark as most recently used; False when ``snap_id`` is not tracked here."""
        if snap_id not in self._live:
            return False
        self._live.move_to_end(snap_id)
        return True

    def forget(self, snap_id: str) -> None:
        self._live.pop(snap_id, None)

    def collect(self) -> int:
        """Stop tracking snapshots that are gone or released; returns how many."""
        n = 0
        for sid, ref in list(self._live.items()):
            s = ref()
            if s is None or s.released:
                del self._live[sid]
                n += 1
        return n

    def snapshots(self) -> list[Any]:
        """The tracked snapshots still alive, least recently used first."""
        return [s for s in (r() for r in self._live.values()) if s is not None]

    def victim(self) -> Any | None:
        """The snapshot to spill now (least recently used), or None within budget."""
        live = self.snapshots()
        if not live:
            return None
        over_n = self.max_in_memory is not None and len(live) > self.max_in_memory
        over_b = self.max_memory is not None and sum(s.memory_bytes() or 0 for s in live) > self.max_memory
        return live[0] if over_n or over_b else None


def disk_evictions(entries: dict[str, dict], recipe: Callable[[str], dict], refs: dict[str, int],
                   chunk_bytes: dict[str, int], max_bytes: int, keep: Collection[str] = ()) -> list[str]:
    """Which stored snapshots to delete, least recently used first, so the store fits ``max_bytes``.

    Args:
        entries: the index entries (``own_bytes``, ``last_used``, ``pinned``) by id.
        recipe: the chunk recipe of a snapshot id.
        refs: how often each chunk is referenced; updated as if the victims were gone (chunks
            down to zero can then be deleted).
        chunk_bytes: each referenced chunk's size on disk.
        max_bytes: the budget.
        keep: ids never to delete (besides pinned ones).

    Returns:
        The ids to delete, in order.
    """
    total = sum(e.get("own_bytes", 0) for e in entries.values()) + sum(chunk_bytes.values())
    order = sorted((e["last_used"], sid) for sid, e in entries.items() if not e.get("pinned") and sid not in keep)
    victims = []
    for _, sid in order:
        if total <= max_bytes:
            break
        total -= entries[sid].get("own_bytes", 0)
        for entry in recipe(sid)["files"].values():
            for c in entry["chunks"]:
                refs[c] -= 1
                if refs[c] == 0:
                    total -= chunk_bytes[c]
        victims.append(sid)
    return victims
