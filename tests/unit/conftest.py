"""Fixtures shared by the unit tests."""

from __future__ import annotations

import socket

import pytest


@pytest.fixture
def pair():
    """Two connected unix stream sockets; a module may override it (e.g. with channels)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.settimeout(20)  # a frame the receiver waits for forever fails the test instead of hanging it
    b.settimeout(20)
    yield a, b
    a.close()
    b.close()
