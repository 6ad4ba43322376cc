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
    logger's chain), or its level set above warnings, that configuration decides, as for any
    record."""
    if not is_rank0():
        return
    last_resort = logging.lastResort
    if logger.hasHandlers() or last_resort is None or logger.getEffectiveLevel() > logging.WARNING:
        logger.info(msg, *args)
        return
    last_resort.handle(logger.makeRecord(logger.name, logging.INFO, "", 0, msg, args, None))
