"""`shown`: a user's value in an error message, at most ~80 characters of it, in bounded time
and memory whatever the value (cost_model/messages.py)."""

from __future__ import annotations

import pytest

from cost_model.messages import SHOWN_LIMIT, shown, shown_count
from cost_model.schema import shown as shown_from_schema


def test_a_short_value_is_its_repr() -> None:
    for value in ["abc", "it's", "a\nb", 8, -3, 1.5, 1e-300, True, None, [1, 2], {"a": 1}, ()]:
        assert shown(value) == repr(value)
    assert shown_from_schema is shown  # the contract's name for it


def test_a_long_string_is_cut_with_its_length() -> None:
    text = shown("a" * 20_000_000)
    assert text == "'" + "a" * 75 + "...' (20,000,000 characters)"
    assert shown(b"b" * 100) == "b'" + "b" * 74 + "...' (100 bytes)"
    # exactly at the limit: whole; one more: cut
    assert shown("c" * (SHOWN_LIMIT - 2)) == repr("c" * (SHOWN_LIMIT - 2))
    assert shown("c" * (SHOWN_LIMIT - 1)).endswith("...' (79 characters)")


def test_escapes_stay_within_the_limit_and_on_one_line() -> None:
    for value in ["\x00" * 1000, "\n" * 1000, "é\t" * 1000, "'\"" * 1000]:
        head = shown(value).split(" (")[0]
        assert len(head) <= SHOWN_LIMIT and "\n" not in head and head.endswith("...'"), head


def test_unquoted_text() -> None:
    assert shown("abc", quoted=False) == "abc"
    assert shown("x" * 100, quoted=False) == "x" * 75 + "... (100 characters)"
    assert shown(3, quoted=False) == "3"


def test_huge_ints_are_shown_by_their_size() -> None:
    # str() of an int over 4,300 digits raises ValueError in Python >= 3.11
    assert shown(10**5000) == "an integer of 5,001 digits"
    assert shown(-(10**99)) == "a negative integer of 100 digits"
    assert shown(10**36) == str(10**36)
    assert shown(2**400_000).startswith("an integer of about 120,4")
    assert shown_count(1024) == "1,024" and shown_count(10**40) == "an integer of 41 digits"


def test_containers_show_a_few_items_of_a_few_levels_and_their_size() -> None:
    assert shown(list(range(10))) == "[0, 1, 2, 3, 4, 5, ...] (a list of 10 items)"
    assert shown({str(i): i for i in range(100)}).endswith("...} (a dict of 100 items)")
    assert shown(["z" * 1000]) == "['" + "z" * 35 + "...'] (a list of 1 item)"
    assert shown([10**10000]) == "[an integer of 10,001 digits]"


def test_shared_references_are_not_walked() -> None:
    """What a YAML alias bomb builds: 9**10 leaves through shared lists; `repr` would need
    tens of GB."""
    value: list[object] = ["lol"] * 9
    for _ in range(10):
        value = [value] * 9
    text = shown(value)
    assert len(text) <= SHOWN_LIMIT + 30 and text.endswith("(a list of 9 items)"), text


def test_an_object_whose_repr_fails_still_has_a_message() -> None:
    class Broken:
        def __repr__(self) -> str:
            raise RuntimeError("no")

    assert shown(Broken()).startswith("<Broken")


@pytest.mark.parametrize("limit", [12, 40, 80, 200])
def test_the_limit_is_kept(limit: int) -> None:
    for value in ["q" * 10_000, list(range(10_000)), {"k" * 500: "v" * 500}]:
        head = shown(value, limit).split(" (")[0]
        assert len(head) <= limit + 1, (limit, head)
