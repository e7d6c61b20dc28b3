"""Who waits, and who goes: the admission rule against a model of it.

The rule is the engine's (``c/src/admission.c``): the publisher's accept thread follows it
in C, the fd server and the remote server through ``_transport.Admission`` (which numbers
their groups for ``_engine.AdmissionBook``).  The model below is the rule in a few lines,
independent of it: at most ``per`` keys of a group wait; one more makes the one longest in
that group go; a deadline is set at admission and kept through moves; a moved key is the
newest of its new group; keys expire in admission order.  Random operations must get the
same answers from both.
"""

from __future__ import annotations

from collections.abc import Hashable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cupy_ipcpool._errors import UsageError
from cupy_ipcpool._transport import Admission


class Model:
    def __init__(self, per: int, timeout: float) -> None:
        self.per, self.timeout = per, timeout
        self.order: list[int] = []  # admission order
        self.entry: dict[int, tuple[Hashable, float]] = {}
        self.joined: dict[int, int] = {}  # when each key came into its group
        self.clock = 0

    def _in(self, group: Hashable) -> list[int]:
        return sorted((k for k in self.order if self.entry[k][0] == group), key=self.joined.get)

    def _room(self, group: Hashable) -> list[int]:
        gone = []
        while len(self._in(group)) >= self.per:
            k = self._in(group)[0]
            gone.append(k)
            self.remove(k)
        return gone

    def admit(self, key: int, group: Hashable, now: float) -> list[int]:
        if key in self.entry:
            raise UsageError(f"{key} is already admitted")
        gone = self._room(group)
        self.order.append(key)
        self.entry[key] = (group, now + self.timeout)
        self.clock += 1
        self.joined[key] = self.clock
        return gone

    def move(self, key: int, group: Hashable) -> list[int]:
        _old, deadline = self.entry[key]  # KeyError
        self.entry[key] = (object(), deadline)  # in no group meanwhile
        gone = self._room(group)
        self.entry[key] = (group, deadline)
        self.clock += 1
        self.joined[key] = self.clock
        return gone

    def remove(self, key: int) -> bool:
        if key not in self.entry:
            return False
        self.order.remove(key)
        del self.entry[key], self.joined[key]
        return True

    def expired(self, now: float) -> list[int]:
        out = []
        for k in list(self.order):
            if self.entry[k][1] > now:
                break
            out.append(k)
            self.remove(k)
        return out

    def next_to_go(self, group: Hashable) -> int | None:
        same = self._in(group)
        return same[0] if len(same) >= self.per else None

    def count(self, group: Hashable | None = None) -> int:
        return len(self.order) if group is None else len(self._in(group))

    def next_deadline(self) -> float | None:
        return self.entry[self.order[0]][1] if self.order else None

    def group(self, key: int) -> Hashable:
        return self.entry[key][0]  # KeyError


GROUPS = st.sampled_from([1000, ("10.0.0.1", 1), ("10.0.0.1", 2)])
KEYS = st.integers(0, 6)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), KEYS, GROUPS),
        st.tuples(st.just("move"), KEYS, GROUPS),
        st.tuples(st.just("admit"), KEYS, GROUPS),
        st.tuples(st.just("move"), KEYS, GROUPS),
        st.tuples(st.just("remove"), KEYS),
        st.tuples(st.just("expired"), st.integers(0, 3)),
        st.tuples(st.just("next_to_go"), GROUPS),
        st.tuples(st.just("count"), st.one_of(st.none(), GROUPS)),
        st.tuples(st.just("group"), KEYS),
    ),
    max_size=60,
)


def _answer(book: object, name: str, args: list[object]) -> tuple[object, ...]:
    try:
        return ("ok", getattr(book, name)(*args))
    except KeyError:
        return ("KeyError",)
    except UsageError as exc:
        return ("UsageError", str(exc))


@settings(max_examples=500, deadline=None)
@given(per=st.integers(1, 3), ops=OPS)
def test_the_book_answers_as_its_rules_say(per: int, ops: list[tuple]) -> None:  # type: ignore[type-arg]
    book, model = Admission(per, 5.0), Model(per, 5.0)
    now = 0.0
    for op in ops:
        name, *args = op
        if name == "admit":
            now += 1.0
            args = [*args, now]
        elif name == "expired":
            args = [now - 5.0 + args[0]]
        got, want = _answer(book, name, args), _answer(model, name, args)
        assert got == want, (op, got, want)
        assert book.next_deadline() == model.next_deadline()
        assert len(book) == model.count()
        for key in range(7):
            assert (key in book) == (key in model.entry)


def test_bad_arguments_are_refused() -> None:
    make = Admission
    with pytest.raises(UsageError, match="per_uid must be at least 1, not 0"):
        make(0, 1.0)
    with pytest.raises(UsageError, match="timeout must be positive"):
        make(1, 0.0)
    book = make(1, 1.0)
    book.admit(3, 0, 0.0)
    with pytest.raises(UsageError, match="3 is already admitted"):
        book.admit(3, 0, 0.0)
    assert "x" not in book


def test_groups_nobody_waits_in_are_forgotten_and_answer_as_new() -> None:
    """A server meets many groups that come and go (the remote server's source addresses):
    the numbers of those nobody waits in are forgotten, so they cost nothing, and such a
    group answers as one nobody ever waited in, also when it comes back."""
    book, model = Admission(2, 5.0), Model(2, 5.0)

    def group(n: int) -> Hashable:
        return (f"10.0.{n // 256}.{n % 256}", n % 2)

    for n in range(600):
        key = n % 4
        if key in model.entry:
            assert book.remove(key) == model.remove(key)
        assert book.admit(key, group(n), float(n)) == model.admit(key, group(n), float(n))
        assert book.group(key) == group(n)
        for old in (n - 3, n - 4, n - 100):  # one still waiting, the others gone
            assert book.count(group(old)) == model.count(group(old))
            assert book.next_to_go(group(old)) == model.next_to_go(group(old))
        assert len(book._ids) <= 2 * len(book) + 9  # the empty groups' numbers went
    for n in range(4):  # back again, each in a group forgotten long ago
        assert book.admit(100 + n, group(n), 600.0) == model.admit(100 + n, group(n), 600.0)
        assert book.group(100 + n) == group(n)
    assert book.expired(603.0) == model.expired(603.0)
