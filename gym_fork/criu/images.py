"""What gym_fork reads out of CRIU image files, and whether a set of images fits this machine.

A restore needs every regular file the dumped processes mapped or held open (the Python binary,
shared libraries, ...) at the same path with the same size, and a CRIU of the same major version:
:func:`mapped_files` lists those files when images are written, :func:`check_compatible` checks
them (and the CRIU version) before a restore is attempted.  :func:`page_chunk_lengths` cuts a
``pages-*.img`` along the dumped memory's virtual addresses, for deduplicating stores.
"""

from __future__ import annotations

import os
import platform
import stat
from collections.abc import Iterator

from gym_fork.criu.status import criu_status
from gym_fork.errors import BundleError

PAGE_SIZE = 4096


def _entries(path: str) -> list[dict]:
    import pycriu

    with open(path, "rb") as f:
        return pycriu.images.load(f)["entries"]


#: ``task_state`` of a process that was stopped (SIGSTOP, job control) when it was dumped
_TASK_STOPPED = 3


def stopped_at_dump(images_dir: str) -> frozenset[int]:
    """The pids (as the dumped tree's PID namespace numbers them) of the processes that were
    stopped when the tree in ``images_dir`` was dumped: a restore that holds the tree stopped
    for a while (``CriuBackend.restore_verified(..., hold_tree=True)``) must leave those stopped
    when it lets the others go on.  Read once per set of images (parsing the cores takes ~10 ms)."""
    st = os.stat(os.path.join(images_dir, "pstree.img"))
    key = (os.path.abspath(images_dir), st.st_dev, st.st_ino, st.st_mtime_ns)
    found = _stopped_cache.get(key)
    if found is None:
        out = set()
        for entry in _entries(os.path.join(images_dir, "pstree.img")):
            pid = entry["pid"]
            core = _entries(os.path.join(images_dir, f"core-{pid}.img"))
            if core and core[0].get("tc", {}).get("task_state") == _TASK_STOPPED:
                out.add(pid)
        found = _stopped_cache[key] = frozenset(out)
        while len(_stopped_cache) > 256:  # (images come and go with their snapshots)
            _stopped_cache.pop(next(iter(_stopped_cache)))
    return found


_stopped_cache: dict[tuple, frozenset[int]] = {}


def mapped_files(images_dir: str, *, skip_append: bool = False) -> list[list]:
    """``[path, size]`` of every regular file the dumped processes map or hold open, sorted.

    Args:
        images_dir: a directory of CRIU images (its ``files.img`` is read).
        skip_append: leave out files open with ``O_APPEND`` (log files that keep growing).

    Returns:
        The list (empty when ``files.img`` cannot be read: the images' checksums catch that).
    """
    try:
        entries = _entries(os.path.join(images_dir, "files.img"))
    except Exception:  # noqa: BLE001 - an unreadable image is caught by the checksums
        return []
    out = []
    for e in entries:
        r = e.get("reg") or {}
        # directories (cwd, root) are REG entries too: keep regular files only
        if e.get("type") != "REG" or not r.get("name", "").startswith("/") or not stat.S_ISREG(r.get("mode", 0)):
            continue
        if skip_append:
            flags = r.get("flags", 0)
            if isinstance(flags, str):
                flags = int(flags, 0)
            if flags & os.O_APPEND:
                continue
        out.append([r["name"], r.get("size", 0)])
    return sorted(out)


def check_compatible(meta: dict, path: str) -> None:
    """Refuse, with the reason, CRIU images this machine cannot restore.

    Args:
        meta: the images' signed metadata: ``criu_version``, ``machine`` and ``files`` (as
            :func:`mapped_files` returns).
        path: what to name in messages (the bundle or checkpoint).

    Raises:
        BundleError: CRIU is unusable here, its major version differs, the architecture differs, or
            a mapped file is missing or has another size.
    """
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


def is_page_image(name: str) -> bool:
    """Whether ``name`` is a CRIU page image (process memory, page by page)."""
    return name.startswith("pages-")


def page_chunk_lengths(pages_path: str, chunk_size: int) -> list[int]:
    """Chunk lengths that cut ``pages_path`` at every pagemap entry and at every ``chunk_size``
    multiple of the *virtual address*, so a page keeps its chunk when other mappings grow or
    shrink between dumps (fixed offsets in the file would shift, and nothing would match).
    Without a usable ``pagemap-*.img`` beside it, the file is cut every ``chunk_size`` bytes.
    """
    total = os.path.getsize(pages_path)
    try:
        return list(_pagemap_lengths(pages_path, chunk_size, total))
    except ValueError:
        return [min(chunk_size, total - off) for off in range(0, total, chunk_size)]


def _pagemap_lengths(src: str, chunk_size: int, total: int) -> Iterator[int]:
    pm = os.path.join(os.path.dirname(src), os.path.basename(src).replace("pages-", "pagemap-", 1))
    try:
        entries = _entries(pm)[1:]
    except Exception:  # noqa: BLE001 - no pagemap (another layout): fixed-size chunks
        entries = []
    done = 0
    for e in entries:
        vaddr, end = e["vaddr"], e["vaddr"] + e["nr_pages"] * PAGE_SIZE
        while vaddr < end:
            nxt = min(end, (vaddr // chunk_size + 1) * chunk_size)
            yield nxt - vaddr
            done += nxt - vaddr
            vaddr = nxt
    if done != total and done:  # the pagemap does not describe this file: start over, fixed
        raise ValueError("pagemap mismatch")
    while done < total:
        yield min(chunk_size, total - done)
        done += chunk_size
