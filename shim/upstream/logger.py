"""``vllm.logger``: ``init_logger`` with upstream's ``*_once`` methods."""

from __future__ import annotations

import logging
import threading
from typing import Any, cast

__all__ = ["init_logger"]

_seen: set[tuple[str, int, str]] = set()
_lock = threading.Lock()


class _Logger(logging.Logger):
    """A stdlib logger with ``debug_once`` / ``info_once`` / ``warning_once``."""

    def _once(self, level: int, msg: str, args: tuple[Any, ...]) -> None:
        key = (self.name, level, msg)
        with _lock:
            if key in _seen:
                return
            _seen.add(key)
        self.log(level, msg, *args, stacklevel=3)

    def debug_once(self, msg: str, *args: Any, **_kwargs: Any) -> None:
        self._once(logging.DEBUG, msg, args)

    def info_once(self, msg: str, *args: Any, **_kwargs: Any) -> None:
        self._once(logging.INFO, msg, args)

    def warning_once(self, msg: str, *args: Any, **_kwargs: Any) -> None:
        self._once(logging.WARNING, msg, args)


def init_logger(name: str) -> _Logger:
    """A logger named ``name`` (upstream: ``vllm.logger.init_logger``)."""
    manager = logging.Logger.manager
    existing = manager.loggerDict.get(name)
    if isinstance(existing, _Logger):
        return existing
    with _lock:
        previous = logging.getLoggerClass()
        logging.setLoggerClass(_Logger)
        try:
            logger = logging.getLogger(name)
        finally:
            logging.setLoggerClass(previous)
    if not isinstance(logger, _Logger):  # created earlier as a plain logger
        logger.__class__ = _Logger
    return cast(_Logger, logger)
