"""On/off switches read from the environment, one reading for all of them."""

from __future__ import annotations

import os

from vllm.attention.errors import InvalidArgumentError

ON_WORDS = ("1", "true", "yes", "on")
"""What turns a switch on (any case, spaces around ignored)."""
OFF_WORDS = ("", "0", "false", "no", "off")
"""What a strict switch reads as off (unset is off too)."""


def env_flag(name: str, *, strict: bool = False) -> bool:
    """Environment variable ``name`` as a switch: on for :data:`ON_WORDS`; off when
    unset or anything else, or, ``strict``, only for :data:`OFF_WORDS`, any other value
    refused with an error naming the variable."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value in ON_WORDS:
        return True
    if strict and value not in OFF_WORDS:
        raise InvalidArgumentError(name, raw, "1, true, yes or on; or unset, 0, false, no "
                                              "or off")
    return False


def env_switch(name: str) -> bool | None:
    """Environment variable ``name`` as a three-way switch: None when unset or empty (the
    caller's default), True for :data:`ON_WORDS`, False for the other
    :data:`OFF_WORDS`; any other value is refused with an error naming the variable."""
    raw = os.environ.get(name, "")
    if not raw.strip():
        return None
    return env_flag(name, strict=True)
