"""Errors for bad user input.

Every error a user can cause (a bad file, a bad flag, an impossible plan) is an `InputError`,
so the CLI can print its one-line message and exit 2 instead of showing a traceback. Messages
say what is wrong, with the value, and how to fix it.
"""

from __future__ import annotations


class InputError(ValueError):
    """A user mistake: bad configuration, file, flag or plan. The message is one clear line."""


class ClusterError(InputError):
    """A Cluster description (preset, YAML file or override) is invalid."""


class SchemaError(InputError):
    """A YAML document does not match its schema (unknown key, wrong type, bad value)."""
