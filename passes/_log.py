"""Logging helpers for the passes: log on global rank 0 only, so N ranks do not repeat a line N
times. Everything goes through `logging` (no print in library code)."""

from __future__ import annotations

import logging

import torch.distributed as dist

__all__ = ["announce_rank0", "is_rank0", "log_rank0"]


def is_rank0() -> bool:
    """True on global rank 0, and in a process with no process group."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def log_rank0(logger: logging.Logger, level: int, msg: str, *args: object) -> None:
    """``logger.log(level, msg, *args)`` on global rank 0 only."""
    if is_rank0():
        logger.log(level, msg, *args)


def announce_rank0(logger: logging.Logger, msg: str, *args: object) -> None:
    """``logger.info(msg, *args)`` on global rank 0 only, shown on stderr even where the program
    configured no logging: Python then prints only warnings, through `logging.lastResort`, so
    the record goes to that handler itself. Where logging is configured (a handler on the
    logger's chain, or a level set on it or on the root), that configuration decides, as for
    any record."""
    if not is_rank0():
        return
    last_resort = logging.lastResort
    if _configured(logger) or last_resort is None:
        logger.info(msg, *args)
        return
    last_resort.handle(logger.makeRecord(logger.name, logging.INFO, "", 0, msg, args, None))


def _configured(logger: logging.Logger) -> bool:
    """Whether the program configured the logging of ``logger``'s records: a handler on its
    chain, a level set on it or an ancestor, or the root's level changed from warnings."""
    node: logging.Logger | None = logger
    while node is not None and node is not logging.root:
        if node.level != logging.NOTSET:
            return True
        node = node.parent if node.propagate else None
    return logger.hasHandlers() or logging.root.level != logging.WARNING
