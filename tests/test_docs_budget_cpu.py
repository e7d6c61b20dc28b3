"""CPU tier: the docs a newcomer reads stay short, and their examples are marked the one way.

Budgets, counted strictly (``len(text.split())`` over the whole file: code
blocks and HTML comments included): ``README.md`` at most
:data:`README_BUDGET` words, ``docs/*.md`` together at most
:data:`DOCS_BUDGET`.  Say each fact once, in one place, and link to it.

Every ```python block of those pages is a test (the root ``conftest.py``,
through Sybil).  A block that cannot run everywhere carries one mark on the
line before it: ``<!-- needs: gpu -->`` (names from the root conftest's
``NEEDS_RULES``) or Sybil's ``<!-- skip: next "why" -->`` for an excerpt.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

README_BUDGET = 1_000
DOCS_BUDGET = 20_000
#: Excerpts that cannot run alone: few, or the docs stop proving what they show.
MAX_FRAGMENTS = 6

FENCE = re.compile(r"^```(\w*)[^\n]*\n", re.M)
MARK = re.compile(r"^<!--\s*(needs|skip):\s*(.*?)\s*-->[ \t]*\n", re.M)


def words(page: Path) -> int:
    return len(page.read_text(encoding="utf-8").split())


def _sizes(pages: list[Path]) -> str:
    return ", ".join(f"{p.relative_to(ROOT)} {words(p)}" for p in sorted(pages, key=words))


def test_readme_stays_within_its_word_budget() -> None:
    n = words(README)
    assert n <= README_BUDGET, f"README.md has {n} words, the budget is {README_BUDGET}"


def test_docs_stay_within_their_word_budget() -> None:
    total = sum(map(words, DOCS))
    assert total <= DOCS_BUDGET, (
        f"docs/*.md have {total} words together, the budget is {DOCS_BUDGET}: {_sizes(DOCS)}"
    )


def _root_conftest():  # the collector of the docs' blocks (its rules, not a copy)
    spec = importlib.util.spec_from_file_location("_docs_conftest", ROOT / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _marks(page: Path) -> list[tuple[int, str, str, str]]:
    """(line, kind, argument, the language of the fence right after it) per mark."""
    text = page.read_text(encoding="utf-8")
    found = []
    for m in MARK.finditer(text):
        rest = text[m.end() :]
        fence = FENCE.match(rest.lstrip("\n"))
        line = text.count("\n", 0, m.start()) + 1
        found.append((line, m.group(1), m.group(2), fence.group(1) if fence else ""))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_marks_sit_right_before_a_python_block(page: Path) -> None:
    known = set(_root_conftest().NEEDS_RULES)
    problems = []
    for line, kind, arg, lang in _marks(page):
        where = f"{page.relative_to(ROOT)}:{line}"
        if lang != "python":
            problems.append(f"{where}: <!-- {kind}: --> is not right before a ```python block")
        if kind == "needs":
            names = {w.strip() for w in arg.split(",") if w.strip()}
            if not names or names - known:
                problems.append(f"{where}: needs {sorted(names - known)}; known: {sorted(known)}")
        else:
            action, _, reason = arg.partition(" ")
            if action != "next" or not reason.strip().strip("\"'"):
                problems.append(f'{where}: write a fragment as <!-- skip: next "why" -->')
    assert not problems, "\n".join(problems)


def test_fragments_are_few() -> None:
    fragments = [
        f"{p.relative_to(ROOT)}:{line}"
        for p in PAGES
        for line, kind, _arg, _lang in _marks(p)
        if kind == "skip"
    ]
    assert len(fragments) <= MAX_FRAGMENTS, fragments


def _sh_lines(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    blocks = re.findall(r"^```sh\n(.*?)^```$", text, flags=re.S | re.M)
    return [ln.strip() for b in blocks for ln in b.splitlines() if ln.strip()]


def test_the_readme_test_command_is_the_one_ci_runs() -> None:
    """README.md, docs/testing.md and .ci/run give the same test command."""
    (readme,) = [ln for ln in _sh_lines(README) if "python3 -m pytest" in ln]
    assert readme in _sh_lines(ROOT / "docs" / "testing.md")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    install, _, test = readme.partition(" && ")
    args = shlex.split(install)
    # .ci/run adds -q to the install and --junitxml to pytest; the extras must be the same
    extras = [a for a in args if a.startswith(".[")]
    ci_line = next((ln for ln in ci.splitlines() if "pip install" in ln and "-e" in ln), "")
    assert extras and all(e in shlex.split(ci_line) for e in extras), (
        f".ci/run installs {ci_line!r}, README.md says {install!r}"
    )
    assert test in ci, f".ci/run does not run {test!r}"
