"""Did anything change a directory tree while a snapshot was taken?

A CRIU dump freezes the env's process tree, copies its memory, and lets it run again; the
workspace (and private directories) are copied *after* that. A thread or a child process of
the env that writes those files meanwhile makes the copied files newer than the copied memory:
a restored copy would find a file that does not go with its state.  The files' stat
signatures, taken before the dump and again after the copy, tell whether that can have
happened (a write changes a file's size, mtime or ctime, or its inode when it is replaced).

Example:
    >>> import os, tempfile
    >>> d = tempfile.mkdtemp()
    >>> before = signature([d])
    >>> with open(os.path.join(d, "a.txt"), "w") as f:
    ...     _ = f.write("x")
    >>> first_change(before, signature([d])) == os.path.join(d, "a.txt")
    True
"""

from __future__ import annotations

import os

Signature = dict[str, tuple[int, int, int, int, int]]


def signature(roots: list[str]) -> Signature:
    """``path -> (inode, mode, size, mtime_ns, ctime_ns)`` for every entry under ``roots``
    (links not followed; entries that vanish while walked are left out)."""
    out: Signature = {}
    for root in roots:
        stack = [root]
        while stack:
            d = stack.pop()
            try:
                with os.scandir(d) as it:
                    entries = list(it)
            except OSError:
                continue
            for e in entries:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                out[e.path] = (st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
    return out


def first_change(before: Signature, after: Signature) -> str | None:
    """A path that was created, removed or changed between the two signatures (sorted first),
    or None."""
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    return changed[0] if changed else None
