"""The docs against their sources: figures, links, limits and defaults (no GPU).

Figures.  Every measured figure in ``README.md`` and ``docs/*.md`` carries a
source marker right after it, an HTML comment that GitHub does not render::

    p50 102 / 101 / 80.1 µs<!-- bench: alternatives-h200.json#A; B; C -->

The marker names a committed result file under ``docs/bench/`` and, for each
number of the figure run just before it (numbers joined by ``/``, an en dash, ``to``
or ``and``), one expression: a path into the JSON (``a.b``, ``list[2]``, or
``list[field=value,field=value]`` for the element whose fields match), or a
product/quotient of paths and numbers (``medians_s.x*1e6``, ``p/q``).  The
quoted number must be the source value rounded to the digits quoted (trailing
zeros of an integer count down to two significant digits: "26,000" stands for
25,500..26,500, "100" for 95..105).

Limits and defaults carry the same kind of marker with ``code:`` and a name
from :data:`CODE_FACTS` (values imported from the package)::

    252<!-- code: MAX_CHANNEL_SLOTS --> slots

A number that looks like a measurement (µs, ms, GB/s, frames/s, the multiplication sign, %) without
a marker fails, as does a numeric cell of a measurement table, except for the
few entries of :data:`NOT_MEASUREMENTS`.  Relative links and ``#anchors``
must resolve, with GitHub's anchor rules.
"""

from __future__ import annotations

import inspect
import json
import math
import re
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BENCH = DOCS / "bench"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

#: Pages whose figures are not checked, and why.
FIGURES_UNCHECKED = {
    # maintained with the C library; it quotes no measurement (checked below)
    "docs/c.md": "edited with the C library; quotes no figure",
}

#: Numbers that look like measurements but are not: (page, text around them, why).
NOT_MEASUREMENTS: list[tuple[str, str, str]] = [
    ("docs/allocator.md", "5 ms, rather than being woken", "a polling interval of the code"),
    ("docs/protocol.md", "every 50 ms at most", "a wait bound of the code"),
    ("docs/protocol.md", "at most every 10 ms", "a polling interval of the code"),
]

_NUM = r"\d[\d,]*(?:\.\d+)?"
_SEP = r"\s*(?:/|\u2013|-|to|and)\s*"
_UNIT = r"(?:\s*(?:µs|ms|GB/s|MB/s|frames/s|\u00d7|%|x\b))?"
_RUN = re.compile(rf"(?:{_NUM}){_UNIT}(?:{_SEP}{_NUM}{_UNIT})*\**\s*$")
_MARKER = re.compile(r"<!--\s*(bench|code):\s*(.*?)\s*-->", re.S)
_MEASURE = re.compile(
    rf"(?<![\w.])({_NUM})(?:{_UNIT}{_SEP}{_NUM})*\s*(µs|ms\b|GB/s|MB/s|frames/s|\u00d7(?!\s*\d)|%)"
)


# -- reading the pages ------------------------------------------------------------------


def rel(page: Path) -> str:
    return page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else page.name


def prose(text: str) -> str:
    """The page with code blocks and code spans blanked (same offsets)."""

    def blank(m: re.Match[str]) -> str:
        return re.sub(r"[^\n]", " ", m.group(0))

    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", blank, text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", blank, text)


@dataclass
class Marker:
    page: str
    line: int
    kind: str
    body: str
    numbers: list[str]


def _run_before(text: str, m: re.Match[str]) -> tuple[int, list[str]]:
    """Where the figure run a marker closes starts, and its numbers."""
    line_start = text.rfind("\n", 0, m.start()) + 1
    bounds = [text.rfind("\n\n", 0, m.start()) + 2, text.rfind("-->", 0, m.start()) + 3]
    if text[line_start:].lstrip().startswith("|"):  # a table row: this cell only
        bounds += [line_start, text.rfind("|", 0, m.start()) + 1]
    start = max(bounds)
    run = _RUN.search(text[start : m.start()])
    if not run:
        return m.start(), []
    return start + run.start(), re.findall(_NUM, run.group(0))


def markers(page: Path) -> list[Marker]:
    text = prose(page.read_text())
    found = []
    for m in _MARKER.finditer(text):
        _start, numbers = _run_before(text, m)
        line = text.count("\n", 0, m.start()) + 1
        found.append(Marker(rel(page), line, m.group(1), m.group(2), numbers))
    return found


# -- the sources ------------------------------------------------------------------------


@cache
def bench_file(name: str) -> Any:
    return json.loads((BENCH / name).read_text())


def lookup(data: Any, path: str) -> float:
    node = data
    for part in re.findall(r"\[\"[^\"]*\"\]|[^.\[\]]+|\[[^\]]*\]", path.strip()):
        if part.startswith('["'):
            node = node[part[2:-2]]
            continue
        if part.startswith("["):
            sel = part[1:-1]
            if sel.isdigit():
                node = node[int(sel)]
                continue
            want = dict(kv.split("=", 1) for kv in sel.split(","))
            hits = [
                e
                for e in node
                if all(str(e.get(k)) == v or _same(e.get(k), v) for k, v in want.items())
            ]
            assert len(hits) == 1, f"{path}: [{sel}] matches {len(hits)} elements"
            node = hits[0]
        else:
            node = node[part]
    assert isinstance(node, int | float), f"{path} is not a number: {node!r}"
    return float(node)


def _same(value: Any, text: str) -> bool:
    try:
        return isinstance(value, int | float) and float(text) == float(value)
    except ValueError:
        return False


def evaluate(data: Any, expr: str) -> float:
    # split on * and / outside brackets (keys may hold either)
    tokens, depth, cur = [], 0, ""
    for c in expr.strip():
        depth += c == "["
        depth -= c == "]"
        if depth == 0 and c in "*/":
            tokens += [cur.strip(), c]
            cur = ""
        else:
            cur += c
    tokens.append(cur.strip())
    value = _term(data, tokens[0])
    for op, term in zip(tokens[1::2], tokens[2::2], strict=True):
        other = _term(data, term)
        value = value * other if op == "*" else value / other
    return value


def _term(data: Any, term: str) -> float:
    if re.fullmatch(r"[\d.]+(e-?\d+)?", term):
        return float(term)
    return lookup(data, term)


def quoted_matches(quoted: str, value: float) -> bool:
    """True when ``quoted`` is ``value`` rounded to the digits it shows."""
    q = quoted.replace(",", "")
    if "." in q:
        step = 10.0 ** -len(q.split(".")[1])
    else:
        digits = q.lstrip("0") or "0"
        zeros = len(digits) - len(digits.rstrip("0"))
        zeros = min(zeros, max(0, len(digits) - 2))  # at least two significant digits
        step = 10.0**zeros
    return abs(float(q) - value) <= step / 2 + 1e-9 * max(1.0, abs(value))


def _signature_default(obj: Callable[..., Any], name: str) -> Any:
    return inspect.signature(obj).parameters[name].default


def _welcome_size(num_slots: int) -> int:
    """The WELCOME payload of a publisher of ``num_slots`` slots, built by the code."""
    from cupy_ipcpool._handles import PoolDescriptor
    from cupy_ipcpool.channel._payload import WELCOME_HEAD

    desc = PoolDescriptor(
        pool_id=b"\x01" * 16,
        exporter_pid=1,
        exporter_uid=0,
        exporter_start_time=1,
        device_uuid=b"\x02" * 16,
        device_ordinal=0,
        num_slots=num_slots,
        slot_nbytes=2 << 20,
        alloc_nbytes=2 << 20,
        fds=tuple(range(3, 3 + num_slots)),
    )
    return WELCOME_HEAD.size + len(desc.to_bytes())


def _publisher(name: str) -> Any:
    from cupy_ipcpool import Publisher

    return _signature_default(Publisher, name)


def _subscribe(name: str) -> Any:
    from cupy_ipcpool import subscribe

    return _signature_default(subscribe, name)


def _import(module: str, name: str) -> Callable[[], Any]:
    def get() -> Any:
        return getattr(__import__(module, fromlist=[name]), name)

    return get


def _c_wire(name: str) -> int:
    """A constant of the C library's generated header, as C sees it."""
    header = (ROOT / "c" / "include" / "cupy_ipcpool_wire.h").read_text()
    m = re.search(rf"^#define {name} (\d+)u?\b", header, re.M)
    assert m, f"{name} is not defined in c/include/cupy_ipcpool_wire.h"
    return int(m.group(1))


def _proto(name: str) -> Any:
    return _import("cupy_ipcpool.channel._protocol", name)()


#: Values the docs quote from the code, by the name a ``code:`` marker gives.
CODE_FACTS: dict[str, Callable[[], Any]] = {
    "MAX_CHANNEL_SLOTS": _import("cupy_ipcpool.channel", "MAX_CHANNEL_SLOTS"),
    "SCM_MAX_FD": _import("cupy_ipcpool._transport", "SCM_MAX_FD"),
    "MAX_SOCKET_PATH": _import("cupy_ipcpool._handles", "MAX_SOCKET_PATH"),
    "MAX_SLOTS": _import("cupy_ipcpool._handles", "MAX_SLOTS"),
    "MAX_ARRAYS": _import("cupy_ipcpool.channel", "MAX_ARRAYS"),
    "MAX_METADATA": _import("cupy_ipcpool.channel", "MAX_METADATA"),
    "MAX_NDIM": _import("cupy_ipcpool._handles._array", "MAX_NDIM"),
    "MAX_CREDIT": _import("cupy_ipcpool.channel._protocol", "MAX_CREDIT"),
    "MAX_FRAME_PAYLOAD_KIB": lambda: (
        _import("cupy_ipcpool.channel._protocol", "MAX_FRAME_PAYLOAD")() // 1024
    ),
    "MAX_HELLO_PAYLOAD_KIB": lambda: (
        _import("cupy_ipcpool.channel._protocol", "MAX_HELLO_PAYLOAD")() // 1024
    ),
    "MAX_REFUSE_REASON_KIB": lambda: (
        _import("cupy_ipcpool.channel._protocol", "MAX_REFUSE_REASON")() // 1024
    ),
    "MAX_WELCOME_PAYLOAD_MIB": lambda: (
        _import("cupy_ipcpool.channel._protocol", "MAX_WELCOME_PAYLOAD")() // (1024 * 1024)
    ),
    "PROTOCOL_VERSION": _import("cupy_ipcpool.channel._protocol", "VERSION"),
    "WELCOME_BASE": lambda: _welcome_size(1) - 4,
    "WELCOME_PER_SLOT": lambda: _welcome_size(2) - _welcome_size(1),
    "WELCOME_HEAD_SIZE": lambda: _import("cupy_ipcpool.channel._payload", "WELCOME_HEAD")().size,
    "HANDSHAKE_TIMEOUT": _import("cupy_ipcpool.channel._handshake", "HANDSHAKE_TIMEOUT"),
    "DEATH_WAIT": _import("cupy_ipcpool.channel._settle", "DEATH_WAIT"),
    "CLOSE_GRACE": _import("cupy_ipcpool.channel._settle", "CLOSE_GRACE"),
    "ACCEPT_BACKOFF_MS": lambda: (
        _import("cupy_ipcpool._transport._accept_loop", "ACCEPT_BACKOFF_S")() * 1000
    ),
    "SETTLE_RECHECK_FIRST_US": lambda: _import("cupy_ipcpool._engine", "SETTLE_RECHECK")()[0] * 1e6,
    "SETTLE_RECHECK_LAST_MS": lambda: _import("cupy_ipcpool._engine", "SETTLE_RECHECK")()[1] * 1000,
    "MAX_DUE_PER_SLOT": lambda: _import("cupy_ipcpool.channel._leases", "default_max_due")()(1),
    "SETTLE_RECHECK_GROWTH": lambda: _import("cupy_ipcpool._engine", "SETTLE_RECHECK")()[2],
    "CIP_WIRE_DEATH_WAIT_MS": lambda: _c_wire("CIP_WIRE_DEATH_WAIT_MS"),
    "CIP_WIRE_CLOSE_WAIT_MS": lambda: _c_wire("CIP_WIRE_CLOSE_WAIT_MS"),
    "CIP_WIRE_UNMAP_WAIT_MS": lambda: _c_wire("CIP_WIRE_UNMAP_WAIT_MS"),
    "MAX_PENDING_PER_UID": _import("cupy_ipcpool._transport._admission", "MAX_PENDING_PER_UID"),
    "LATEST_RESERVE": lambda: _import("cupy_ipcpool.channel._leases", "default_latest_reserve")()(
        8
    ),
    "Publisher.max_subscribers": lambda: _publisher("max_subscribers"),
    "Publisher.send_timeout": lambda: _publisher("send_timeout"),
    "subscribe.timeout": lambda: _subscribe("timeout"),
    "remote.serve.max_pending_per_address": lambda: _signature_default(
        _import("cupy_ipcpool.remote", "serve")(), "max_pending_per_address"
    ),
    "remote.serve.handshake_timeout": lambda: _signature_default(
        _import("cupy_ipcpool.remote", "serve")(), "handshake_timeout"
    ),
    "remote.serve.send_timeout": lambda: _signature_default(
        _import("cupy_ipcpool.remote", "serve")(), "send_timeout"
    ),
    "remote.MAX_RELAY_SLOTS": _import("cupy_ipcpool.remote._cli", "MAX_RELAY_SLOTS"),
    "remote.MAX_ARRAYS": _import("cupy_ipcpool.remote._wire", "MAX_ARRAYS"),
    "remote.MAX_NDIM": _import("cupy_ipcpool.remote._wire", "MAX_NDIM"),
    "remote.MAX_METADATA": _import("cupy_ipcpool.remote._wire", "MAX_METADATA"),
}

#: Facts a page must state with a ``code:`` marker (so that removing one fails).
REQUIRED_FACTS = {
    "docs/wire.md": {
        "MAX_CHANNEL_SLOTS",
        "SCM_MAX_FD",
        "WELCOME_BASE",
        "WELCOME_PER_SLOT",
        "MAX_ARRAYS",
        "MAX_METADATA",
        "HANDSHAKE_TIMEOUT",
        "MAX_PENDING_PER_UID",
        "PROTOCOL_VERSION",
    },
    "docs/protocol.md": {
        "Publisher.max_subscribers",
        "Publisher.send_timeout",
        "subscribe.timeout",
        "DEATH_WAIT",
        "CLOSE_GRACE",
    },
    "docs/c.md": {"CIP_WIRE_CLOSE_WAIT_MS", "CIP_WIRE_UNMAP_WAIT_MS", "CIP_WIRE_DEATH_WAIT_MS"},
    "docs/transports.md": {"ACCEPT_BACKOFF_MS", "MAX_SOCKET_PATH"},
    "docs/remote.md": {"remote.MAX_ARRAYS", "remote.MAX_NDIM", "remote.MAX_METADATA"},
}


def all_markers() -> Iterator[Marker]:
    for page in PAGES:
        yield from markers(page)


# -- figures ----------------------------------------------------------------------------


def bench_problems(found: Iterator[Marker] | list[Marker]) -> tuple[int, list[str]]:
    """How many figures the bench markers check, and what disagrees."""
    checked = 0
    problems = []
    for mk in found:
        if mk.kind != "bench":
            continue
        name, _, exprs = mk.body.partition("#")
        where = f"{mk.page}:{mk.line}"
        if not (BENCH / name).is_file():
            problems.append(f"{where}: no docs/bench/{name}")
            continue
        parts = [e for e in exprs.split(";") if e.strip()]
        if len(parts) != len(mk.numbers):
            problems.append(
                f"{where}: {len(parts)} source(s) for the figures {mk.numbers or '(none)'}"
            )
            continue
        for quoted, expr in zip(mk.numbers, parts, strict=True):
            try:
                value = evaluate(bench_file(name), expr)
            except (KeyError, IndexError, AssertionError, TypeError) as exc:
                problems.append(f"{where}: {expr.strip()}: {exc}")
                continue
            checked += 1
            if not quoted_matches(quoted, value):
                problems.append(f"{where}: quotes {quoted}, {name}#{expr.strip()} is {value:.6g}")
    return checked, problems


def test_every_bench_marker_matches_its_source() -> None:
    checked, problems = bench_problems(all_markers())
    assert not problems, "\n".join(problems)
    assert checked > 100


def test_every_code_marker_matches_the_code() -> None:
    problems = []
    for mk in all_markers():
        if mk.kind != "code":
            continue
        where = f"{mk.page}:{mk.line}"
        if mk.body not in CODE_FACTS:
            problems.append(f"{where}: unknown fact {mk.body!r} (add it to CODE_FACTS)")
            continue
        if len(mk.numbers) != 1:
            problems.append(f"{where}: {mk.body} marks {mk.numbers or 'no number'}")
            continue
        value = CODE_FACTS[mk.body]()
        if not math.isclose(float(mk.numbers[0].replace(",", "")), float(value)):
            problems.append(f"{where}: quotes {mk.numbers[0]} for {mk.body}, the code has {value}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", sorted(REQUIRED_FACTS))
def test_required_facts_are_marked(page: str) -> None:
    marked = {mk.body for mk in markers(ROOT / page) if mk.kind == "code"}
    assert REQUIRED_FACTS[page] <= marked, REQUIRED_FACTS[page] - marked


def _allowed(page: str, text: str, start: int) -> bool:
    for p, snippet, _why in NOT_MEASUREMENTS:
        if p != page:
            continue
        for m in re.finditer(re.escape(snippet), text):
            if m.start() <= start < m.end():
                return True
    return False


def unsourced(page: Path) -> list[str]:
    """Measurement-like numbers of ``page`` that no marker covers."""
    name = rel(page)
    text = prose(page.read_text())
    spans = [(_run_before(text, m)[0], m.end()) for m in _MARKER.finditer(text)]

    def is_covered(pos: int) -> bool:
        return any(a <= pos < b for a, b in spans)

    clean = _MARKER.sub(lambda x: " " * len(x.group(0)), text)
    problems = []
    for m in _MEASURE.finditer(clean):
        if is_covered(m.start()) or _allowed(name, text, m.start()):
            continue
        line = text.count("\n", 0, m.start()) + 1
        problems.append(f"{name}:{line}: {m.group(0)!r} has no source marker")
    problems += _unsourced_cells(name, text, is_covered)
    return problems


_MEASURE_HEADER = re.compile(r"µs|frames/s|GB/s|p50|p99|ratio|result|\u00d7", re.I)


def _unsourced_cells(name: str, text: str, is_covered: Callable[[int], bool]) -> list[str]:
    """Numeric cells of tables whose header names a measurement."""
    problems = []
    lines = text.split("\n")
    offset = [0]
    for line in lines:
        offset.append(offset[-1] + len(line) + 1)
    measuring = False
    for i, line in enumerate(lines):
        if not line.lstrip().startswith("|"):
            measuring = False
            continue
        if i + 1 < len(lines) and re.match(r"\s*\|[\s:|-]+\|\s*$", lines[i + 1]):
            measuring = bool(_MEASURE_HEADER.search(_MARKER.sub("", line)))
            continue
        if not measuring or re.match(r"\s*\|[\s:|-]+\|\s*$", line):
            continue
        pos = offset[i]
        cells = line.split("|")
        for j, cell in enumerate(cells):
            start = pos
            pos += len(cell) + 1
            if j <= 1:  # before the first | and the label column
                continue
            # a cell with a marker is checked by the marker's test (its figure run)
            bare = cell.strip().strip("*").strip()
            if _MARKER.search(cell) or not re.search(_NUM, bare):
                continue
            if not _allowed(name, text, start + cell.find(bare)):
                problems.append(f"{name}:{i + 1}: table cell {bare!r} has no source marker")
    return problems


@pytest.mark.parametrize("page", [rel(p) for p in PAGES])
def test_no_unsourced_figures(page: str) -> None:
    if page in FIGURES_UNCHECKED:
        # still: it must quote no measurement, or it belongs in the checked pages
        assert not [p for p in unsourced(ROOT / page) if "table cell" not in p], page
        return
    problems = unsourced(ROOT / page)
    assert not problems, "\n".join(problems)


def test_marker_check_fails_on_an_edited_figure(tmp_path: Path) -> None:
    """The checker itself: a figure edited away from its source is caught."""
    value = bench_file("alternatives-h200.json")["measurements"][0]["p50_us"]
    expr = "measurements[lane=cupy_ipcpool,size_mib=1.0].p50_us"
    assert quoted_matches(f"{value:.3g}", evaluate(bench_file("alternatives-h200.json"), expr))
    assert not quoted_matches(f"{value * 1.1:.3g}", value)
    assert quoted_matches("26,000", 25981) and not quoted_matches("26,000", 25400)
    assert quoted_matches("100", 102) and not quoted_matches("100", 110)
    page = tmp_path / "p.md"
    page.write_text("p50 9.99 µs, then 3 / 4 ms<!-- bench: x.json#a; b -->\n")
    assert len(markers(page)[0].numbers) == 2
    page.write_text("| lane | p50 µs |\n| --- | ---: |\n| a | 12 |\n")
    assert _unsourced_cells("p.md", page.read_text(), lambda _pos: False)
    # the README with one figure edited away from its source
    readme = (ROOT / "README.md").read_text()
    assert "28\u00d7<!--" in readme
    page.write_text(readme.replace("28\u00d7<!--", "38\u00d7<!--"))
    _checked, problems = bench_problems(markers(page))
    assert len(problems) == 1 and "quotes 38" in problems[0]
    page.write_text(
        readme.replace("28\u00d7<!--", "28\u00d7 <!-- ").replace("<!-- bench", "<!-- b", 1)
    )
    assert unsourced(page)  # a figure whose marker is gone


# -- links ------------------------------------------------------------------------------


def github_anchor(heading: str) -> str:
    text = re.sub(r"<[^>]+>", "", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = text.replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in page.read_text().split("\n"):
        if re.match(r"\s*(```|~~~)", line):
            in_code = not in_code
        if in_code:
            continue
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = github_anchor(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def links(page: Path) -> Iterator[tuple[int, str]]:
    text = prose(page.read_text())
    for m in re.finditer(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
        yield text.count("\n", 0, m.start()) + 1, m.group(1)


@pytest.mark.parametrize("page", [rel(p) for p in PAGES])
def test_links_and_anchors_resolve(page: str) -> None:
    src = ROOT / page
    problems = []
    for line, target in links(src):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (src.parent / path).resolve() if path else src
        if not dest.exists():
            problems.append(f"{page}:{line}: {target}: no such file")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{page}:{line}: {target}: no heading with that anchor")
    assert not problems, "\n".join(problems)


def test_github_anchor_rules() -> None:
    assert (
        github_anchor("What a consumer does after a death") == "what-a-consumer-does-after-a-death"
    )
    assert github_anchor("`block` and `latest`: delivery") == "block-and-latest-delivery"
    assert github_anchor("Python peer of a C producer") == "python-peer-of-a-c-producer"


# -- other statements the docs make about the code -------------------------------------


def test_install_counts_and_extras() -> None:
    import tomllib

    setup = (ROOT / "setup.py").read_text()
    n_ext = setup.count("Extension(")
    words = {1: "one", 2: "two", 3: "three", 4: "four"}
    install = (DOCS / "install.md").read_text()
    assert f"builds {words[n_ext]} small C extensions" in install
    assert f"{words[n_ext].capitalize()} small C extensions" in install
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for extra in extras:
        assert f"`{extra}`" in install, f"install.md does not list the {extra!r} extra"


def test_no_install_from_an_index_by_name() -> None:
    """The package is on no index: every install hint works from a checkout."""
    problems = []
    for page in PAGES:
        for i, line in enumerate(page.read_text().split("\n"), 1):
            for m in re.finditer(r"pip install ([^`\n&;]*)", line):
                args = m.group(1)
                if re.search(r"cupy[_-]ipcpool", args) and not (
                    rel(page) == "docs/c.md" and "does not build it" in line
                ):  # c.md (edited with the C library) says what such an install lacks
                    problems.append(f"{rel(page)}:{i}: {m.group(0)}")
    assert not problems, "\n".join(problems)


def test_publisher_takes_the_arguments_the_docs_show() -> None:
    from cupy_ipcpool import Publisher

    params = set(inspect.signature(Publisher).parameters)
    text = (DOCS / "protocol.md").read_text()
    sig = re.search(r"pub = cip\.Publisher\((.*?)\)\n", text, re.S)
    assert sig, "protocol.md shows Publisher's signature"
    shown = set(re.findall(r"(\w+)=", sig.group(1)))
    assert shown <= params, shown - params
    # settings of the session core that Publisher does not take are not presented as its own
    for name in ("handshake_timeout", "max_pending_per_uid"):
        assert name not in params
        for page in (DOCS / "protocol.md", DOCS / "wire.md"):
            for line in page.read_text().split("\n"):
                if f"`{name}`" in line:
                    assert "PublisherCore" in line, f"{rel(page)}: {line.strip()}"


def test_slot_order_is_said_the_same_everywhere() -> None:
    """The code scans round-robin (SlotTable.take, LeaseBook.pick_free_slot)."""
    slots = (ROOT / "cupy_ipcpool" / "_slots.py").read_text()
    assert "round-robin" in slots
    for page in PAGES:
        text = page.read_text().lower()
        assert "least recently used" not in text, rel(page)


HISTORY = re.compile(
    r"\b(this week|previous session|last session|now fixed|was fixed|attempt(ed|s)?|"
    r"used to|no longer measured)\b",
    re.I,
)


@pytest.mark.parametrize("page", [rel(p) for p in PAGES if rel(p) != "docs/c.md"])
def test_docs_say_what_is_true_now(page: str) -> None:
    hits = [
        f"{page}:{i}: {line.strip()}"
        for i, line in enumerate((ROOT / page).read_text().split("\n"), 1)
        if HISTORY.search(line)
    ]
    assert not hits, "\n".join(hits)
