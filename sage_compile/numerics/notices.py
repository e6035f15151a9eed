"""Warnings told once per reason: shared by the kernel dispatcher, the ops and the site reports."""
from __future__ import annotations

import re
import warnings

_warned: set = set()


def warn_once(scope, reason: str, message: str, stacklevel: int = 3) -> None:
    """Warn ``message`` once per ``scope`` and reason — numbers aside, so one line serves every key length."""
    key = (scope, re.sub(r"\d+", "N", reason))
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=stacklevel)
