"""Gymnasium's own env checker, run on the env itself, inside its worker.

Through the learner's stand-in (``ForkableEnv``) the checker cannot see the env's bugs: the
stand-in answers with the worker's spaces and its own methods.  Here it runs on the base env
(``env.unwrapped``, as Gymnasium recommends), and what it raised and warned is answered as data
for :func:`gym_fork.check_env` to report.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def gymnasium_check(env: Any, skip_render_check: bool = True) -> dict:
    """``gymnasium.utils.env_checker.check_env(env)``: ``{"error": "Type: message" or None,
    "warnings": [messages, in order, each once]}``."""
    from gymnasium.utils.env_checker import check_env

    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            check_env(env, skip_render_check=skip_render_check)
        except Exception as e:  # noqa: BLE001 - the verdict, not a failure of the check itself
            error = f"{type(e).__name__}: {_ANSI.sub('', str(e))}"
    seen: list[str] = []
    for w in caught:
        text = _ANSI.sub("", str(w.message)).removeprefix("WARN: ").strip()
        if text not in seen:
            seen.append(text)
    return {"error": error, "warnings": seen}
