"""Give a fresh fork-tier copy its page tables before it is needed, off the critical path.

``fork()`` copies the page-table entries of anonymous memory (write-protected, copy-on-write) but
*not* those of file mappings: the kernel leaves them out because a fault can fill them again from
the page cache.  A new copy therefore takes a minor fault on every page of code and read-only data
it runs for the first time -- libpython, NumPy, the simulator's shared library -- and the first
request a restored copy serves (and the step after it) pays for hundreds of them.  On a virtual
machine each fault costs several microseconds, so this was most of what a fork-tier ``restore()``
cost beyond the hand-over itself.

:func:`populate_file_mappings` fills those entries in one ``madvise(MADV_POPULATE_READ)`` call per
mapping (Linux 5.14 or later).  It costs no memory (the pages are the page cache's, shared with the
original), never changes what a copy computes (only page tables are filled, no byte is written), and
runs where nobody waits: in a spare copy that is not serving yet, and in a frozen snapshot before
it forks its spare.  On older kernels it does nothing.

Writable private memory is left alone: populating it for writing would break copy-on-write, giving
every spare a private copy of the whole heap (tens of MB per snapshot).

Example:
    >>> populate_file_mappings() >= 0
    True
"""

from __future__ import annotations

import ctypes
import errno

MADV_POPULATE_READ = 22  # Linux >= 5.14: fault in page tables, readable, like a read of every page
_ok = True
_libc: ctypes.CDLL | None = None


def _file_ranges() -> list[tuple[int, int]]:
    """(start, end) of this process's readable, not writable mappings of files (code, read-only
    data). The kernel's own areas ([vdso], [vvar], ...) are left out: they cannot be populated."""
    out = []
    with open("/proc/self/maps", "rb") as f:
        for line in f:
            parts = line.split(None, 5)
            perms = parts[1]
            if perms[0:1] != b"r" or perms[1:2] == b"w":
                continue
            if len(parts) < 6 or not parts[5].startswith(b"/"):
                continue  # anonymous or a kernel area: nothing to gain
            start, end = parts[0].split(b"-")
            out.append((int(start, 16), int(end, 16)))
    return out


def populate_file_mappings() -> int:
    """Fill this process's page tables for its read-only file mappings.

    Returns:
        How many mappings were populated (0 where the kernel lacks ``MADV_POPULATE_READ``).
    """
    global _ok, _libc
    if not _ok:
        return 0
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    done = invalid = 0
    try:
        ranges = _file_ranges()
    except OSError:
        return 0
    for start, end in ranges:
        if _libc.madvise(start, end - start, MADV_POPULATE_READ) == 0:
            done += 1
        elif ctypes.get_errno() == errno.EINVAL:
            invalid += 1  # a device mapping, or (all of them) a kernel without the advice
        # EFAULT/ENOMEM: a mapping that went away, or a file truncated under it: skip it
    if done == 0 and invalid == len(ranges) and ranges:
        _ok = False  # an older kernel: do not try again
    return done
