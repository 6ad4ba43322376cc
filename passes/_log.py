"""Logging helpers for the passes: log on global rank 0 only, so N ranks do not repeat a line N
times. Everything goes through `logging` (no print in library code)."""

from __future__ import annotations

import logging

import torch.distributed as dist

__all__ = ["is_rank0", "log_rank0"]


def is_rank0() -> bool:
    """True on global rank 0, and in a process with no process group."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def log_rank0(logger: logging.Logger, level: int, msg: str, *args: object) -> None:
    """``logger.log(level, msg, *args)`` on global rank 0 only."""
    if is_rank0():
        logger.log(level, msg, *args)
