"""The token between drivers, job supervisors and Ray nodes' migration hosts: ``token=`` /
``$GYM_FORK_TOKEN`` / ``$GYM_FORK_TOKEN_FILE`` where set, else one derived from the gym_fork HMAC
key, which every node must share anyway to verify bundles. Hosts resolve theirs on their own node
the same way, so an explicit token must also be in the hosts' environment (``runtime_env``)."""

from __future__ import annotations

import hashlib
import hmac

from gym_fork import keys
from gym_fork.migration.wire.auth import load_token


def resolve_token(token: str | bytes | None = None) -> bytes:
    """The token for connections to migration hosts (see the module doc)."""
    try:
        return load_token(token)
    except (ValueError, OSError):
        return hmac.new(keys.get_key(), b"gym_fork ray bridge token v1", hashlib.sha256).hexdigest().encode()
