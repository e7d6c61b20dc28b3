"""Write the generated part of docs/reference.md from the public ``__all__`` lists.

Run from the repository root after adding, removing or changing a public name::

    python -m tests.gen_reference          # rewrite docs/reference.md in place
    python -m tests.gen_reference --check  # exit 1 if it is out of date

Everything between the two marker lines is generated (signatures and the
first line of each docstring); the text around them is kept.
``tests/test_reference_cpu.py`` checks the page against the code.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pathlib
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

#: The public modules, in the order the page lists them.
MODULES = ("cupy_ipcpool", "cupy_ipcpool.channel", "cupy_ipcpool.remote")
PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "reference.md"
BEGIN = "<!-- BEGIN GENERATED: python -m tests.gen_reference -->"
END = "<!-- END GENERATED -->"

#: One line for the public names that are values, not functions or classes.
CONSTANTS = {
    "__version__": "The package's version.",
    "MAX_ARRAYS": "The most arrays one frame may carry.",
    "MAX_CHANNEL_SLOTS": (
        "The most slots a published pool may have (one fd per slot and the sync page's "
        "travel in one `SCM_RIGHTS` message)."
    ),
    "MAX_METADATA": "The most bytes of user metadata one frame may carry.",
}


@dataclass(frozen=True)
class Entry:
    """One public name: where it is, how it is called, what it is."""

    module: str
    name: str
    signature: str
    summary: str

    @property
    def qualname(self) -> str:
        """``module.name``."""
        return f"{self.module}.{self.name}"


def _default(value: Any) -> str:
    text = repr(value)
    return "..." if " at 0x" in text or len(text) > 40 else text


def render_signature(name: str, obj: Any) -> str:
    """How the page writes ``obj``'s call: parameter names, kinds and defaults, no annotations.

    Exceptions are written as their class line (``class E(Base)``), constants as
    ``NAME = value``.
    """
    if isinstance(obj, type) and issubclass(obj, BaseException):
        bases = ", ".join(b.__name__ for b in obj.__bases__)
        return f"class {name}({bases})"
    if not callable(obj):
        return f"{name} = {obj!r}"
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return f"{name}(...)"
    parts: list[str] = []
    star_done = False
    params = list(sig.parameters.values())
    for i, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star_done = True
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        elif p.default is p.empty:
            parts.append(p.name)
        else:
            parts.append(f"{p.name}={_default(p.default)}")
        last_positional_only = p.kind is p.POSITIONAL_ONLY and (
            i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY
        )
        if last_positional_only:
            parts.append("/")
    return f"{name}({', '.join(parts)})"


def summary(name: str, obj: Any) -> str:
    """The first paragraph of ``obj``'s docstring on one line, in Markdown.

    Values (constants) take their line from :data:`CONSTANTS`.
    """
    if not callable(obj):
        return CONSTANTS.get(name, "")
    doc = (inspect.getdoc(obj) or "").strip()
    paragraph = " ".join(doc.split("\n\n", 1)[0].split())
    paragraph = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", paragraph)  # :class:`X` -> `X`
    return paragraph.replace("``", "`")


def entries() -> Iterator[Entry]:
    """Every public name of :data:`MODULES`, in page order (module, then ``__all__`` sorted)."""
    first: dict[int, str] = {}
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in sorted(getattr(module, "__all__", ()), key=str.lower):
            obj = getattr(module, name)
            line = summary(name, obj)
            seen = first.get(id(obj)) if callable(obj) else None
            if seen is not None:
                line = f"The same object as `{seen}`."
            elif callable(obj):
                first[id(obj)] = f"{module_name}.{name}"
            yield Entry(module_name, name, render_signature(name, obj), line)


def generated() -> str:
    """The text between the markers."""
    out: list[str] = []
    current = None
    for e in entries():
        if e.module != current:
            current = e.module
            out += ["", f"## `{e.module}`", ""]
        out += [f"### `{e.qualname}`", "", "```text", e.signature, "```", ""]
        if e.summary:
            out += [e.summary, ""]
    return "\n".join(out).strip("\n")


def rewrite(text: str) -> str:
    """``text`` (the page) with its generated part replaced."""
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{PAGE}: the marker lines {BEGIN!r} and {END!r} are missing")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n\n{generated()}\n\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    """Rewrite (or, with ``--check``, verify) docs/reference.md; return the exit code."""
    parser = argparse.ArgumentParser(prog="python -m tests.gen_reference", description=__doc__)
    parser.add_argument("--check", action="store_true", help="only say whether it is current")
    args = parser.parse_args(argv)
    old = PAGE.read_text(encoding="utf-8")
    new = rewrite(old)
    if args.check:
        if new != old:
            print(f"{PAGE} is out of date: run python -m tests.gen_reference")
            return 1
        return 0
    if new != old:
        PAGE.write_text(new, encoding="utf-8")
        print(f"rewrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
