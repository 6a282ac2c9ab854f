"""Snapshot data: the :class:`Snapshot` handle, the bundle format, the snapshot store (index,
chunks, budgets), session directories, durable writes and workspaces.  Pure data: nothing here
knows how a backend takes, keeps or restores a snapshot; it asks the snapshot's backend."""
