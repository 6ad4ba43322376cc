"""A user's value, shortened for a one-line error message.

Error messages show the value that was wrong; a value from a file or a command line can be a
20 MB string, a list of a million items or an integer of a million digits. `shown` renders
any value in about ``limit`` characters and in time and memory bounded by ``limit`` (it never
calls ``repr`` on a whole container or string), saying how long the original was.
`cost_model.schema` re-exports it; every message that embeds a user's value goes through it.
"""

from __future__ import annotations

import difflib
import reprlib
from collections.abc import Iterable
from typing import Any

SHOWN_LIMIT = 80
# An int of more digits than this is shown by its size: str() of a long int costs quadratic
# time and Python refuses beyond 4,300 digits (`sys.get_int_max_str_digits`).
_INT_DIGITS = 40


class _Short(reprlib.Repr):
    """reprlib's bounded repr (a few items of a few levels), with long ints made safe."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxtuple = self.maxlist = self.maxset = self.maxfrozenset = self.maxdeque = 6
        self.maxdict = 4
        self.maxstring = max(limit // 2, 12)
        self.maxlong = _INT_DIGITS
        self.maxother = max(limit // 2, 12)

    def repr_int(self, x: int, level: int) -> str:
        return _int_text(x)

    def repr_str(self, x: str, level: int) -> str:
        return _str_text(x, self.maxstring)[0]


def shown(value: object, limit: int = SHOWN_LIMIT, *, quoted: bool = True) -> str:
    """``repr(value)`` when it fits in ``limit`` characters; otherwise its start, ``...`` and
    its size: ``'aaaa...' (20,000,000 characters)``, ``[[1, 2], ...] (a list of 9 items)``,
    ``an integer of about 5,000 digits``. A string without its quotes with ``quoted=False``
    (``num_layers=abc``; escapes such as ``\n`` stay, so the message stays one line)."""
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        return _int_text(value)
    if isinstance(value, (str, bytes)):
        text, cut = _str_text(value, limit)
        if not quoted and isinstance(value, str):
            text = text[1:-1]
        if not cut:
            return text
        unit = "characters" if isinstance(value, str) else "bytes"
        return f"{text} ({len(value):,} {unit})"
    try:
        text = _Short(limit).repr(value)
    except Exception:  # a user's object whose __repr__ fails still gets a message
        text = f"<{type(value).__name__}>"
    if len(text) > limit:
        text = text[: max(limit - 3, 1)] + "..."
    elif "..." not in text:
        return text
    size = _size(value)
    return f"{text} ({size})" if size else text


def did_you_mean(name: str, choices: Iterable[str], n: int = 2) -> str:
    """``did you mean a or b? `` for the ``n`` choices nearest ``name`` (difflib's ratio, or a
    choice that contains it: ``h100`` for ``dgx-h100-80g``); empty when none is near."""
    options = list(choices)
    close = difflib.get_close_matches(name, options, n=n, cutoff=0.6)
    close += [c for c in options if len(name) >= 3 and name in c and c not in close]
    return f"did you mean {' or '.join(close[:n])}? " if close else ""


def shown_count(number: int) -> str:
    """``1,024``; an absurd count by its size (``str`` of a huge int is slow or refused)."""
    return f"{number:,}" if abs(number) < 10**30 else _int_text(number)


def _str_text(value: str | bytes, limit: int) -> tuple[str, bool]:
    """``repr`` of ``value``, cut to about ``limit`` characters with ``...`` inside the quotes,
    and whether it was cut."""
    if len(value) <= limit:
        whole = repr(value)
        if len(whole) <= limit:
            return whole, False
    keep = max(limit - 5, 1)
    while True:  # escapes (\x00 is four characters) make the repr longer than the slice
        text = repr(value[:keep])
        if len(text) <= limit - 3 or keep == 1:
            return text[:-1] + "..." + text[-1], True
        keep = max(min(keep - 1, keep * (limit - 3) // len(text)), 1)


def _int_text(value: int) -> str:
    bits = abs(value).bit_length()
    if bits <= _INT_DIGITS * 3:  # < 10**36: at most 37 digits, cheap and always allowed
        return repr(value)
    digits = int((bits - 1) * 0.30103) + 1  # log10(2): exact or one too few
    about = "about "
    if bits < 100_000:  # 10**digits is cheap up to here: make the count exact
        digits += abs(value) >= 10**digits
        about = ""
    sign = "a negative" if value < 0 else "an"
    return f"{sign} integer of {about}{digits:,} digits"


def _size(value: Any) -> str | None:
    """``a list of 9 items`` for a sized container, else None."""
    try:
        count = len(value)
    except Exception:
        return None
    kind = type(value).__name__
    article = "an" if kind[:1] in "aeiou" else "a"
    unit = "item" if count == 1 else "items"
    return f"{article} {kind} of {count:,} {unit}"
