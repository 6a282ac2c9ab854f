"""The HMAC key that authenticates bundles (pickle payloads, migrated snapshots).

Taken from ``$GYM_FORK_KEY`` (hex, or any string) or the key file ``$GYM_FORK_KEY_FILE``
(default ``~/.config/gym_fork/hmac.key``, created with 32 random bytes and mode 0600 on first
use).  Every machine that loads a bundle must share the key of the machine that saved it.
"""

from __future__ import annotations

import hashlib
import hmac
import os


def key_file() -> str:
    return os.environ.get("GYM_FORK_KEY_FILE") or os.path.join(
        os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config"), "gym_fork", "hmac.key")


def get_key(create: bool = True) -> bytes | None:
    env = os.environ.get("GYM_FORK_KEY")
    if env:
        try:
            return bytes.fromhex(env)
        except ValueError:
            return env.encode()
    path = key_file()
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        if not create:
            return None
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    key = os.urandom(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, key)
    finally:
        os.close(fd)
    return key


def sign(data: bytes, key: bytes | None = None) -> str:
    return hmac.new(key if key is not None else get_key(), data, hashlib.sha256).hexdigest()


def verify(data: bytes, mac: str, key: bytes | None = None) -> bool:
    return hmac.compare_digest(sign(data, key), mac or "")
