"""CPU tier: docs/reference.md lists every public name with its current signature, and no other.

The public names are the ``__all__`` lists of ``cupy_ipcpool``,
``cupy_ipcpool.channel`` and ``cupy_ipcpool.remote``.  When a check fails,
its message says which entry to add, fix or remove; ``python -m
tests.gen_reference`` rewrites the whole generated part in one go.
"""

from __future__ import annotations

import re

import pytest

from tests import gen_reference as gen

REGENERATE = "or regenerate the page: python -m tests.gen_reference"
_ENTRY = re.compile(r"^### `([\w.]+)`\n\n```text\n(.*?)\n```", re.MULTILINE)


def _page() -> dict[str, str]:
    """``qualname -> signature`` as docs/reference.md writes them."""
    text = gen.PAGE.read_text(encoding="utf-8")
    found: dict[str, str] = {}
    for qualname, signature in _ENTRY.findall(text):
        assert qualname not in found, f"docs/reference.md lists `{qualname}` twice"
        found[qualname] = signature
    return found


def _entry_text(e: gen.Entry) -> str:
    return f"### `{e.qualname}`\n\n```text\n{e.signature}\n```\n\n{e.summary}"


def test_every_public_name_is_listed_with_its_current_signature():
    page = _page()
    problems = []
    for e in gen.entries():
        if e.qualname not in page:
            problems.append(
                f"`{e.qualname}` is public (in {e.module}.__all__) but docs/reference.md has "
                f"no entry for it; add under '## `{e.module}`':\n\n{_entry_text(e)}\n"
            )
        elif page[e.qualname] != e.signature:
            problems.append(
                f"docs/reference.md gives `{e.qualname}` as\n    {page[e.qualname]}\n"
                f"but the code's signature is\n    {e.signature}\nfix the entry"
            )
    assert not problems, "\n\n".join([*problems, REGENERATE])


def test_nothing_listed_that_is_not_public():
    public = {e.qualname for e in gen.entries()}
    extra = sorted(set(_page()) - public)
    assert not extra, (
        "docs/reference.md lists names that are in no public __all__ "
        f"({', '.join(gen.MODULES)}): {', '.join(f'`{n}`' for n in extra)}; remove their "
        f"entries, {REGENERATE}"
    )


def test_the_generated_part_is_current():
    text = gen.PAGE.read_text(encoding="utf-8")
    assert gen.rewrite(text) == text, (
        "docs/reference.md's generated part (signatures and summaries) is out of date; "
        "run: python -m tests.gen_reference"
    )


# -- the renderer the page and the checks above rely on ------------------------------------


def _example(a, b=2, /, c=None, *args, d, e="x", **kw):
    """Summary line that goes on
    to a second line.

    Not this paragraph.
    """


_SENTINEL = object()


class _Failure(ValueError, RuntimeError):
    """The class line carries the bases."""


@pytest.mark.parametrize(
    ("name", "obj", "expected"),
    [
        ("f", _example, "f(a, b=2, /, c=None, *args, d, e='x', **kw)"),
        ("g", lambda x, *, y=1: None, "g(x, *, y=1)"),
        ("E", _Failure, "class E(ValueError, RuntimeError)"),
        ("LIMIT", 64, "LIMIT = 64"),
        ("h", lambda s=_SENTINEL: None, "h(s=...)"),  # an address in a default is not shown
    ],
)
def test_render_signature(name, obj, expected):
    assert gen.render_signature(name, obj) == expected


def test_summary_is_the_first_paragraph_in_markdown():
    assert gen.summary("f", _example) == "Summary line that goes on to a second line."

    def roles():
        """Return a :class:`~cupy_ipcpool.IpcPool` or ``None``."""

    assert gen.summary("roles", roles) == "Return a `cupy_ipcpool.IpcPool` or `None`."
    assert gen.summary("MAX_ARRAYS", 64) == gen.CONSTANTS["MAX_ARRAYS"]


def test_rewrite_keeps_the_text_around_the_markers():
    text = f"intro\n{gen.BEGIN}\nold stuff\n{gen.END}\noutro\n"
    new = gen.rewrite(text)
    assert new.startswith(f"intro\n{gen.BEGIN}\n\n## `cupy_ipcpool`")
    assert new.endswith(f"\n\n{gen.END}\noutro\n")
    assert "old stuff" not in new
    with pytest.raises(SystemExit, match="marker"):
        gen.rewrite("no markers here")
