"""The docs' Python blocks as tests, through Sybil.

Every ```python block of ``README.md`` and ``docs/*.md`` is a test; the blocks of
one page run in order, in one namespace, in a scratch directory of that page
(so a socket path such as ``"cam.sock"`` is the page's own).  One page's blocks
must run in one process: under pytest-xdist, ``--dist loadfile``.

A block is one of:

- a CPU block (no mark): runs everywhere, CI included;
- a block that needs something, marked by a comment on the line before it,
  ``<!-- needs: gpu -->`` (or ``gpu, torch``, ``ucxx``): it carries the ``gpu``
  pytest marker where it needs a GPU, and is skipped with a reason where what it
  needs is missing (the GPU rule is ``tests/conftest.py``'s, not a second one);
- a fragment (an excerpt of a bigger program), marked with Sybil's own
  ``<!-- skip: next "why" -->``.

``tests/test_docs_budget_cpu.py`` checks that every mark names something known
and sits right before a Python block.  Tests marked ``docs_shell`` (the docs'
shell commands in fresh venvs, ``tests/test_docs_shell_cpu.py``) run only when
selected: ``python3 -m pytest -m docs_shell``.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent
DOC_PAGES = frozenset([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

#: ``<!-- needs: a, b -->`` right before a block (only blank space between them).
NEEDS = re.compile(r"<!--\s*needs:\s*(?P<what>[\w ,-]+?)\s*-->\s*\Z")


def _close_leftovers(namespace: dict[str, Any]) -> None:
    """Close what a page's blocks left open (the newest first), as a user's exit would."""
    for value in reversed(list(namespace.values())):
        if type(value).__module__.startswith("cupy_ipcpool") and callable(
            getattr(value, "close", None)
        ):
            value.close()
    namespace.clear()


@cache
def _collector() -> Callable[[Path, pytest.Collector], pytest.Collector]:
    """Sybil's collector of the doc pages, made when the first page is collected (raises
    ImportError without Sybil)."""
    from sybil import Sybil
    from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

    sybil = Sybil(
        parsers=[PythonCodeBlockParser(), SkipParser()],
        patterns=["*.md"],
        fixtures=["_doc_page_cwd"],
        teardown=_close_leftovers,
    )
    return sybil.pytest()


class _SybilMissing(pytest.File):
    """A doc page where Sybil is not installed: an error when the page itself is
    collected, so a run of ``tests/`` alone (the GPU machine's ``scripts/gpu-test``)
    does not need Sybil, and a run of the docs does not pass without it."""

    def collect(self) -> list[pytest.Item]:
        raise pytest.UsageError(
            f"{self.path.name}: the docs' Python blocks are tests run through Sybil, which "
            "is not installed: install the test extra (python3 -m pip install -e '.[test]')"
        )


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if file_path.resolve() not in DOC_PAGES:
        return None
    try:
        collect = _collector()
    except ImportError:
        return _SybilMissing.from_parent(parent, path=file_path)
    return collect(file_path, parent)


@pytest.fixture
def _doc_page_cwd(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[None]:
    """Each page's blocks run in that page's own scratch directory."""
    dirs: dict[Path, Path] = request.config.stash.setdefault(_PAGE_DIRS, {})
    page = request.node.path
    if page not in dirs:
        dirs[page] = tmp_path_factory.mktemp(page.stem)
    monkeypatch.chdir(dirs[page])
    yield


_PAGE_DIRS = pytest.StashKey[dict[Path, Path]]()


# -- what a block needs -----------------------------------------------------------------


def _gpu_missing() -> str | None:
    """Why the GPU tier cannot run here: the one rule, ``tests/conftest.py``'s."""
    reason: str | None = importlib.import_module("tests.conftest")._gpu_skip_reason()
    return reason


def _ucxx_missing() -> str | None:
    from cupy_ipcpool.remote import available

    missing = available()
    return (
        None if missing is None else f"needs UCXX (a remote-cu13 or remote-cu12 extra): {missing}"
    )


def _module_missing(name: str) -> Callable[[], str | None]:
    def missing() -> str | None:
        return None if importlib.util.find_spec(name) else f"needs {name}, not installed here"

    return missing


#: What a ``needs:`` mark may name, and how to tell that it is missing.
NEEDS_RULES: dict[str, Callable[[], str | None]] = {
    "gpu": _gpu_missing,
    "ucxx": _ucxx_missing,
    "torch": _module_missing("torch"),
    "jax": _module_missing("jax"),
}


def block_needs(item: pytest.Item) -> list[str]:
    """The names of a Sybil item's ``needs:`` mark ([] for a block without one)."""
    example = getattr(item, "example", None)
    if example is None:
        return []
    text, start = example.document.text, example.region.start
    if not text.startswith("```", start):
        return []
    m = NEEDS.search(text, 0, start)
    return [w.strip() for w in m.group("what").split(",") if w.strip()] if m else []


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "docs_shell: runs the docs' shell commands in fresh venvs (minutes, needs the package "
        "index); left out of a run unless selected: python3 -m pytest -m docs_shell",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "docs_shell" not in (config.option.markexpr or ""):
        shell = [item for item in items if item.get_closest_marker("docs_shell")]
        if shell:
            config.hook.pytest_deselected(items=shell)
            items[:] = [item for item in items if not item.get_closest_marker("docs_shell")]
    missing = cache(lambda name: NEEDS_RULES[name]() if name in NEEDS_RULES else None)
    for item in items:
        needs = block_needs(item)
        if "gpu" in needs:
            item.add_marker(pytest.mark.gpu)
        reasons = [r for r in map(missing, needs) if r]
        if reasons and item.get_closest_marker("skip") is None:
            item.add_marker(pytest.mark.skip(reason="; ".join(reasons)))
