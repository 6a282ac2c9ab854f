"""Snapshot data: the :class:`Snapshot` handle, bundles, the snapshot store, session
directories and workspaces.  Pure data: nothing here knows how a backend takes a snapshot."""
