"""The GIL check of tests/_gil.py tells a call that lets other threads run from one that won't."""

from __future__ import annotations

import ctypes

import pytest
from _gil import assert_gil_released

LIBC_POLL = ("poll", "ppoll")


def test_a_call_that_releases_the_gil_passes() -> None:
    assert assert_gil_released(lambda: ctypes.CDLL(None).poll(None, 0, 300), LIBC_POLL) == 0


def test_a_call_that_holds_the_gil_fails() -> None:
    # ctypes.PyDLL keeps the GIL across the foreign call
    with pytest.raises(AssertionError, match="no other thread ran"):
        assert_gil_released(lambda: ctypes.PyDLL(None).poll(None, 0, 300), LIBC_POLL)
