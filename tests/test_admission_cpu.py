"""Who waits, and who goes: the admission rule's two copies against a model of it.

The rule lives in C for the publisher's accept thread (``c/src/admission.c``, here through
``_engine.AdmissionBook``) and in Python for the fd server and the remote server
(``_transport.Admission``): the transport layer sits below the engine and cannot call it,
until the fd server moves into the engine.  The model below is the rule in a few lines,
independent of both: at most ``per`` keys of a group wait; one more makes the one longest
in that group go; a deadline is set at admission and kept through moves; a moved key is
the newest of its new group; keys expire in admission order.  Random operations must get
the same answers from all three.
"""

from __future__ import annotations

from collections.abc import Hashable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cupy_ipcpool import _compiled
from cupy_ipcpool._errors import UsageError
from cupy_ipcpool._transport import Admission


class EngineBook:
    """``_engine.AdmissionBook`` with the groups numbered (it keeps 64-bit ints)."""

    def __init__(self, per: int, timeout: float) -> None:
        self.book = _compiled.load("cupy_ipcpool._engine").AdmissionBook(per, timeout)
        self.ids: dict[Hashable, int] = {}

    def _id(self, group: Hashable) -> int:
        return self.ids.setdefault(group, len(self.ids))

    def admit(self, key: int, group: Hashable, now: float) -> list[int]:
        return self.book.admit(key, self._id(group), now)

    def move(self, key: int, group: Hashable) -> list[int]:
        return self.book.move(key, self._id(group))

    def group(self, key: int) -> Hashable:
        gid = self.book.group(key)
        return next(g for g, i in self.ids.items() if i == gid)

    def next_to_go(self, group: Hashable) -> int | None:
        return self.book.next_to_go(self._id(group))

    def count(self, group: Hashable | None = None) -> int:
        return self.book.count() if group is None else self.book.count(self._id(group))

    def __getattr__(self, name: str) -> object:  # remove, expired, next_deadline
        return getattr(self.book, name)

    def __contains__(self, key: object) -> bool:
        return key in self.book

    def __len__(self) -> int:
        return len(self.book)


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


@pytest.mark.parametrize("make", [EngineBook, Admission], ids=["engine", "python"])
@settings(max_examples=500, deadline=None)
@given(per=st.integers(1, 3), ops=OPS)
def test_the_book_answers_as_its_rules_say(make: type, per: int, ops: list[tuple]) -> None:  # type: ignore[type-arg]
    book, model = make(per, 5.0), Model(per, 5.0)
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


@pytest.mark.parametrize("make", [EngineBook, Admission], ids=["engine", "python"])
def test_bad_arguments_are_refused(make: type) -> None:
    with pytest.raises(UsageError, match="per_uid must be at least 1, not 0"):
        make(0, 1.0)
    with pytest.raises(UsageError, match="timeout must be positive"):
        make(1, 0.0)
    book = make(1, 1.0)
    book.admit(3, 0, 0.0)
    with pytest.raises(UsageError, match="3 is already admitted"):
        book.admit(3, 0, 0.0)
    assert "x" not in book
