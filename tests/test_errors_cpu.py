"""CPU tier: one error model, the layer order of the imports, descriptor pickles that leak nothing.

* Every failure path reachable without a GPU raises a subclass of
  :class:`IpcPoolError` (argument errors stay ``ValueError``/``TypeError``/
  ``IndexError`` too, timeouts ``TimeoutError``), and every class pickles.
* The package's import graph has no cycle and no upward edge in the layer
  order of DESIGN.md, lazy (function-level) imports included.
* Pickling a :class:`PoolDescriptor` outside multiprocessing keeps no fds.
"""

from __future__ import annotations

import ast
import inspect
import os
import pathlib
import pickle
import re
from collections.abc import Iterator
from typing import Any

import pytest

import cupy_ipcpool as cip
from cupy_ipcpool import _errors
from cupy_ipcpool._arena import AllocationScope, SlotArena
from cupy_ipcpool._handles import ArrayHandle, PoolDescriptor
from cupy_ipcpool._slots import SlotTable
from cupy_ipcpool._vmm import UndoStack, round_up
from tests._fds import fds_opened_since, open_fds

PACKAGE = pathlib.Path(cip.__file__).parent
ROOT = PACKAGE.parent


# ----------------------------------------------------------------- error classes


def _all_exception_classes() -> list[type[BaseException]]:
    return [
        obj
        for obj in vars(_errors).values()
        if inspect.isclass(obj)
        and issubclass(obj, Exception)
        and obj.__module__ == _errors.__name__
    ]


def test_every_error_class_derives_from_the_base_and_pickles() -> None:
    samples: dict[type[BaseException], tuple[Any, ...]] = {
        cip.CudaError: ("cuMemMap", 1, "CUDA_ERROR_INVALID_VALUE"),
        cip.CudaOutOfMemoryError: ("cuMemCreate", 2, "CUDA_ERROR_OUT_OF_MEMORY"),
        cip.TransportError: (1, "no"),
        cip.PeerRefusedError: ("refused",),
        cip.SlotFullError: (10, 5, 0, 100),
        cip.EndOfStream: ("gone", True),
    }
    for cls in _all_exception_classes():
        if issubclass(cls, Warning):
            continue
        assert issubclass(cls, cip.IpcPoolError), cls
        args = next((v for k, v in samples.items() if issubclass(cls, k)), ("message",))
        try:
            exc = cls(*args)
        except TypeError:
            continue  # a subclass with its own signature, covered by its own test
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is cls and str(back) == str(exc)


def test_driver_errors_say_what_to_do_under_mps() -> None:
    # an MPS client ended by the server: the message says why and what to do, and pickles
    exc = _errors.cuda_error("cuStreamSynchronize", 810, "CUDA_ERROR_MPS_CLIENT_TERMINATED")
    assert type(exc) is cip.CudaError and exc.code == 810
    text = str(exc)
    assert text.startswith("cuStreamSynchronize: CUDA_ERROR_MPS_CLIENT_TERMINATED (810): ")
    assert "another client" in text and "restart the process" in text
    assert str(pickle.loads(pickle.dumps(exc))) == text
    # a faulting kernel's sticky error names the MPS consequence too
    sticky = _errors.cuda_error("cuStreamSynchronize", 700, "CUDA_ERROR_ILLEGAL_ADDRESS")
    assert "cannot be used again" in str(sticky) and "every client" in str(sticky)
    assert "nvidia-cuda-mps-control -d" in _errors.cuda_error_hint(
        "CUDA_ERROR_MPS_CONNECTION_FAILED"
    )
    # out of memory keeps its class; an error with nothing to add keeps the bare message
    oom = _errors.cuda_error("cuMemCreate", 2, "CUDA_ERROR_OUT_OF_MEMORY")
    assert type(oom) is cip.CudaOutOfMemoryError
    plain = _errors.cuda_error("cuMemMap", 1, "CUDA_ERROR_INVALID_VALUE")
    assert str(plain) == "cuMemMap: CUDA_ERROR_INVALID_VALUE (1)"
    # every hint names a real driver error
    driver = pytest.importorskip("cuda.bindings.driver")
    for name in _errors.CUDA_ERROR_HINTS:
        assert hasattr(driver.CUresult, name), name


def test_usage_errors_are_also_the_builtin_kinds() -> None:
    assert issubclass(cip.UsageError, ValueError)
    assert issubclass(cip.UsageTypeError, TypeError)
    assert issubclass(cip.SlotIndexError, IndexError)
    assert issubclass(cip.SlotBusyError, TimeoutError)


def _raises(call: Any, cls: type[BaseException]) -> BaseException:
    with pytest.raises(cls) as info:
        call()
    assert isinstance(info.value, cip.IpcPoolError), type(info.value)
    return info.value


def test_failure_paths_without_a_gpu_raise_library_errors() -> None:
    # arena
    _raises(lambda: SlotArena(1024, alignment=100), cip.UsageError)
    _raises(lambda: SlotArena(1024).alloc(-1), cip.UsageError)
    _raises(lambda: SlotArena(1024).free(0), cip.UsageError)
    _raises(lambda: SlotArena(100).alloc(1000), cip.SlotFullError)
    _raises(
        lambda: AllocationScope(SlotArena(1024), 0, None, SlotTable(1), 0, "bogus"), cip.UsageError
    )
    # slot table
    table = SlotTable(1)
    table.take(0)
    _raises(lambda: table.take(0), cip.SlotBusyError)
    # handles and descriptors
    _raises(lambda: ArrayHandle.from_bytes(b"\x00" * 5), cip.DescriptorError)
    _raises(lambda: ArrayHandle(0, 0, 0, (4,), (4,), "object"), cip.DescriptorError)
    _raises(
        lambda: ArrayHandle(0, 3, 0, (4,), (4,), "float32").check_generation(4),
        cip.StaleHandleError,
    )
    _raises(lambda: PoolDescriptor.from_bytes(b"nope"), cip.DescriptorError)
    _raises(lambda: ArrayHandle.peek(b"\x00" * 10), cip.DescriptorError)
    # vmm helpers
    _raises(lambda: round_up(0, 4096), cip.UsageError)
    # attach needs a descriptor
    _raises(lambda: cip.attach("not a descriptor"), cip.UsageTypeError)  # type: ignore[arg-type]
    # arrays: shapes and dtypes
    from cupy_ipcpool._arrays import normalize_dtype, normalize_shape, stream_ptr

    _raises(lambda: normalize_shape(object()), cip.UsageTypeError)
    _raises(lambda: normalize_shape((-1,)), cip.DescriptorError)
    _raises(lambda: normalize_dtype("U4"), cip.DescriptorError)
    _raises(lambda: stream_ptr("not a stream"), cip.UsageTypeError)


def test_streams_are_read_from_every_protocol() -> None:
    from cupy_ipcpool._arrays import stream_ptr

    class Protocol:
        def __cuda_stream__(self) -> tuple[int, int]:
            return (0, 1234)

    class TorchLike:
        cuda_stream = 99

    class CupyLike:
        ptr = 7

    assert stream_ptr(5) == 5
    assert stream_ptr(Protocol()) == 1234
    assert stream_ptr(TorchLike()) == 99
    assert stream_ptr(CupyLike()) == 7


def test_undo_stack_runs_steps_newest_first_and_warns_on_failures() -> None:
    done: list[str] = []

    def fail() -> None:
        raise OSError("boom")

    with pytest.warns(cip.TeardownWarning, match="boom"), UndoStack() as undo:
        undo.push(done.append, "first")
        undo.push(fail)
        undo.push(done.append, "last")
    assert done == ["last", "first"]
    with UndoStack() as undo:
        undo.push(done.append, "never")
        undo.commit()
    assert "never" not in done


# ---------------------------------------------------------------- compiled parts


def _load_at_site(name: str) -> Any:
    """The library's own call that loads the compiled module ``name`` (as a pool or a channel)."""
    from cupy_ipcpool.channel import _sockets, _syncpage

    if name == "cupy_ipcpool._fastpath":
        return _syncpage._memops()
    for attr in ("pollfds", "recv_frame", "release_frame", "send_frame", "wait_releases"):
        _sockets.__dict__.pop(attr, None)  # loaded again, as at the first session
    return _sockets._load_frameio()


#: Each compiled module, the constants it exports, and the Python definitions they must equal.
def _expected_constants() -> dict[str, dict[str, object]]:
    from cupy_ipcpool.channel import _sockets, _syncpage

    return {
        "cupy_ipcpool._engine": {"PROTOCOL": _sockets._PROTOCOL},
        "cupy_ipcpool._fastpath": {"MAX_BATCH": _syncpage._MAX_BATCH},
    }


COMPILED = ("cupy_ipcpool._fastpath", "cupy_ipcpool._engine")


def test_each_build_exports_the_layouts_of_the_python_definitions() -> None:
    import importlib

    from cupy_ipcpool.channel import _protocol as proto

    for name, constants in _expected_constants().items():
        module = importlib.import_module(name)
        for attr, want in constants.items():
            assert getattr(module, attr) == want, (name, attr)
    # the FRAME message's header before its payload (the engine's per-frame calls)
    engine = importlib.import_module("cupy_ipcpool._engine")
    assert engine.PROTOCOL[4] == proto.MAX_FRAME_SIZE - proto.MAX_FRAME_PAYLOAD == 20
    for name in COMPILED:  # and the sites accept this build
        try:
            _load_at_site(name)
        except cip.CudaUnavailableError:  # loaded and checked; the driver comes next
            assert name == "cupy_ipcpool._fastpath"


@pytest.mark.parametrize("name", COMPILED)
def test_a_missing_build_is_one_error_naming_the_fix(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib
    import sys

    from cupy_ipcpool import _info

    parent, _, leaf = name.rpartition(".")
    monkeypatch.delattr(importlib.import_module(parent), leaf)
    monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError) as info:
        _load_at_site(name)
    text = str(info.value)
    assert text.startswith(f"{name}, a compiled part of cupy_ipcpool, is not built")
    assert "python setup.py build_ext --inplace" in text and "pip install ." in text
    assert f"NOT BUILT ({leaf})" in _info.fastpath_summary()
    assert SlotTable(2).take(0) == (1, 1)  # a pool's bookkeeping needs no compiled part


def test_the_missing_build_text_is_the_same_for_every_part(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from cupy_ipcpool import _compiled

    texts = set()
    for name in COMPILED:
        monkeypatch.setitem(sys.modules, name, None)
        with pytest.raises(ImportError) as info:
            _compiled.load(name)
        texts.add(str(info.value).replace(name, "NAME"))
    assert len(texts) == 1, texts


@pytest.mark.parametrize(
    ("name", "attr"),
    [
        ("cupy_ipcpool._engine", "PROTOCOL"),
        ("cupy_ipcpool._fastpath", "MAX_BATCH"),
    ],
)
@pytest.mark.parametrize("change", ["differs", "missing"])
def test_a_build_of_other_layouts_is_refused_naming_the_constant(
    name: str, attr: str, change: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    module = importlib.import_module(name)
    built = getattr(module, attr)
    if change == "missing":  # a build older than the constant
        monkeypatch.delattr(module, attr)
    elif isinstance(built, tuple):
        monkeypatch.setattr(module, attr, (built[0] + 1, *built[1:]))
    else:
        monkeypatch.setattr(module, attr, built + 1)
    with pytest.raises(ImportError) as info:
        _load_at_site(name)
    text = str(info.value)
    assert text.startswith(f"{name} was built from other sources than this code ({attr}: ")
    assert "rebuild it" in text and "python setup.py build_ext --inplace" in text


def test_compiled_parts_are_loaded_only_through_the_loader() -> None:
    """No module imports a compiled part itself (type-checking imports aside)."""
    compiled = {name.rpartition(".")[2] for name in COMPILED}
    found = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        typing_only = {
            id(node)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for node in ast.walk(block)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom):
                names = {(node.module or "").rpartition(".")[2], *(a.name for a in node.names)}
            elif isinstance(node, ast.Import):
                names = {a.name.rpartition(".")[2] for a in node.names}
            else:
                continue
            if names & compiled:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not found, f"compiled parts imported outside cupy_ipcpool._compiled.load: {found}"


# --------------------------------------------------------------- import layers

#: The layers of DESIGN.md, bottom first; a module may import its own layer and below.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("errors", ("_errors", "_version", "_args", "_compiled")),
    ("handles", ("_handles", "_handles.*")),
    ("driver", ("_driver", "_fastpath")),
    ("vmm", ("_vmm",)),
    ("transport", ("_transport", "_transport.*", "transport.*")),
    ("pool", ("_arrays", "_slots", "_arena", "_pool")),
    ("peer", ("_peer", "_seedpeer")),
    ("allocator", ("_allocator", "_compat")),
    ("engine", ("_engine",)),
    (
        "channel",
        ("channel.*",),
    ),
    ("remote", ("remote.*",)),
    ("application", ("__init__", "__main__", "_connect", "_demo", "_info", "_bench.*")),
]


def _layer_of(module: str) -> int:
    for index, (_name, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            if (
                module == pattern
                or (pattern.endswith(".*") and module.startswith(pattern[:-1]))
                or (pattern.endswith(".*") and module == pattern[:-2] + ".__init__")
            ):
                return index
    raise AssertionError(
        f"module {module} is in no layer: add it to LAYERS in tests/test_errors_cpu.py "
        "(and to the layer table in docs/index.md)"
    )


def _module_name(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def _imports(path: pathlib.Path) -> Iterator[str]:
    """Modules of the package that ``path`` imports, at any depth of the file."""
    package = list(path.relative_to(PACKAGE).parts[:-1])
    # compiled modules have a stub (.pyi) beside their C source
    modules = {_module_name(p) for pattern in ("*.py", "*.pyi") for p in PACKAGE.rglob(pattern)}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
            elif node.module and node.module.split(".")[0] == "cupy_ipcpool":
                base = []
                node_module = node.module.split(".")[1:]
                target = ".".join(node_module)
                for alias in node.names:
                    sub = ".".join([*node_module, alias.name])
                    yield sub if sub in modules else (target or "__init__")
                continue
            else:
                continue
            target = ".".join(base + (node.module.split(".") if node.module else []))
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                if sub in modules:
                    yield sub
                elif f"{sub}.__init__" in modules:  # a subpackage: from . import _handles
                    yield f"{sub}.__init__"
                else:
                    yield target if target in modules else f"{target}.__init__".lstrip(".")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "cupy_ipcpool":
                    yield ".".join(parts[1:]) or "__init__"


def _loads(path: pathlib.Path) -> Iterator[str]:
    """Modules of the package that ``path`` loads by name: ``load("cupy_ipcpool.x")`` or
    ``loader(...)`` (the compiled parts' loaders) or ``importlib.import_module(...)``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        first = node.args[0]
        if (
            called in ("load", "loader", "import_module")
            and isinstance(first, ast.Constant)
            and isinstance(first.value, str)
            and first.value.startswith("cupy_ipcpool.")
        ):
            yield first.value.split(".", 1)[1]


# -- what the compiled code touches: the C sources, scanned ----------------------------

#: A C source's imports: PyImport_ImportModule("cupy_ipcpool.x") and its kin.
_C_IMPORT = re.compile(r'PyImport_\w*\(\s*"([\w.]+)"')
#: The names of attributes a C source reads, writes or calls on the objects it is given.
_C_ATTRIBUTE = [
    re.compile(r'PyObject_(?:Get|Set|Has|Del)AttrString\s*\([^;]*?"(\w+)"'),
    re.compile(r'PyObject_CallMethod\w*\s*\([^;"]*?"(\w+)"'),
    re.compile(r'PyUnicode_InternFromString\s*\(\s*"(\w+)"'),
    # the modules' helper around PyUnicode_InternFromString: intern(&S_name, "name")
    re.compile(r'\bintern\s*\(\s*&\w+\s*,\s*"(\w+)"'),
]


def _c_sources() -> dict[str, str]:
    """Compiled module name -> the text of its C sources: a source with a stub beside it in
    the package, and the engine's binding (c/python; c/src touches no Python object)."""
    sources = {
        _module_name(c): c.read_text()
        for c in PACKAGE.rglob("*.c")
        if c.with_suffix(".pyi").exists()
    }
    sources["_engine"] = "".join(c.read_text() for c in sorted((ROOT / "c" / "python").glob("*.c")))
    return sources


def _c_imports(text: str) -> set[str]:
    return {
        m.split(".", 1)[1] if "." in m else "__init__"
        for m in _C_IMPORT.findall(text)
        if m.split(".")[0] == "cupy_ipcpool"
    }


def _c_attributes(text: str) -> set[str]:
    return {name for pattern in _C_ATTRIBUTE for name in pattern.findall(text)}


def _attribute_owners() -> dict[str, set[str]]:
    """Attribute name -> the package's modules whose classes define it (assigned to
    ``self``, in the class body, in ``__slots__``, or as a method or property)."""
    owners: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        for cls in ast.walk(ast.parse(path.read_text())):
            if not isinstance(cls, ast.ClassDef):
                continue
            names: set[str] = set()
            for node in cls.body:
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(node.name)
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    names.add(node.target.id)
                elif isinstance(node, ast.Assign):
                    for target in node.targets:
                        if isinstance(target, ast.Name) and target.id == "__slots__":
                            names.update(
                                e.value
                                for e in ast.walk(node.value)
                                if isinstance(e, ast.Constant) and isinstance(e.value, str)
                            )
                        elif isinstance(target, ast.Name):
                            names.add(target.id)
            for node in ast.walk(cls):
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "self"
                ):
                    names.add(node.attr)
            for name in names:
                owners.setdefault(name, set()).add(module)
    return owners


def _c_attribute_violations(
    module: str, attributes: set[str], owners: dict[str, set[str]]
) -> set[str]:
    """The attributes a compiled ``module`` touches that break the layer rules: defined
    only above its layer, or private and defined only in other layers."""
    level = _layer_of(module)
    found = set()
    for name in attributes:
        layers = {_layer_of(m) for m in owners.get(name, ())}
        if not layers:
            continue  # not the package's (a lock's acquire, CuPy's or Python's own)
        if min(layers) > level:
            found.add(f"{module} ({LAYERS[level][0]}) touches .{name}, defined only above")
        elif name.startswith("_") and not name.startswith("__") and level not in layers:
            found.add(f"{module} ({LAYERS[level][0]}) touches the private .{name} of another layer")
    return found


#: What of the engine the layers below it may use: the transport-level rules it holds
#: (``_engine`` itself imports nothing above ``_errors``).
ENGINE_BELOW = frozenset(
    {
        "AdmissionBook",
        "check_socket_path",
        "bind_listen",
        "unlink_if_ours",
        "fetch_fds",
        "process_start_time",
        "TRANSPORT_AUTO",
        "TRANSPORT_PIDFD",
        "TRANSPORT_SOCKET",
        "FdServer",
    }
)


def _engine_uses(path: pathlib.Path) -> set[str]:
    """The names a module takes from the engine it loads (``_engine().Name``)."""
    return set(re.findall(r"\b_engine\(\)\.(\w+)", path.read_text()))


def _graph() -> dict[str, set[str]]:
    graph = {}
    below = _layer_of("_engine")
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        graph[name] = {m for m in (*_imports(path), *_loads(path)) if m != name}
        if _layer_of(name) < below and _engine_uses(path) <= ENGINE_BELOW:
            graph[name].discard("_engine")  # its transport-level rules only
    for name, source in _c_sources().items():
        graph[name] = _c_imports(source) - {name}
    return graph


def test_no_upward_import_between_layers() -> None:
    upward = []
    for module, deps in sorted(_graph().items()):
        level = _layer_of(module)
        for dep in sorted(deps):
            if _layer_of(dep) > level:
                upward.append(
                    f"{module} ({LAYERS[level][0]}) imports {dep} ({LAYERS[_layer_of(dep)][0]})"
                )
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_import_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if dep == "__init__" or dep.endswith(".__init__"):
                continue  # importing the package itself is the application layer's business
            if state.get(dep) == 1:
                cycle = [*stack[stack.index(dep) :], dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_the_graph_holds_the_compiled_parts_and_the_loads_by_name() -> None:
    graph = _graph()
    compiled = set(_c_sources())
    assert compiled == {"_fastpath", "_engine"}
    assert compiled <= set(graph)
    assert "_engine" in graph["channel._sockets"]
    assert {"_errors"} <= graph["_engine"]  # the exceptions it raises
    assert "_fastpath" in graph["channel._syncpage"]
    # the transport uses the engine's admission book, and nothing else of it
    assert _engine_uses(PACKAGE / "_transport" / "_admission.py") == {"AdmissionBook"}
    assert "_engine" not in graph["_transport._admission"]


def test_a_lower_layer_taking_more_of_the_engine_is_an_upward_import(
    tmp_path: pathlib.Path,
) -> None:
    """Below the engine, ``_engine().AdmissionBook`` is allowed; any other name is not."""
    allowed = tmp_path / "allowed.py"
    allowed.write_text("book = _engine().AdmissionBook(8, 1.0)\n")
    assert _engine_uses(allowed) <= ENGINE_BELOW
    more = tmp_path / "more.py"
    more.write_text("book = _engine().AdmissionBook(8, 1.0)\nrows = _engine().ReaderRows\n")
    assert _engine_uses(more) == {"AdmissionBook", "ReaderRows"}
    assert not _engine_uses(more) <= ENGINE_BELOW


def test_the_c_scanner_finds_imports_and_attributes() -> None:
    """A negative control: what the checks below would see in a C source that broke the rules."""
    text = """
        PyObject *m = PyImport_ImportModule("cupy_ipcpool.channel._session");
        PyObject *v = PyObject_GetAttrString(obj, "_book");
        PyObject_SetAttrString(obj, "holder", x);
        PyObject_CallMethod(lock, "acquire", "O", Py_False);
        intern(&S_mem, "_memptr");
    """
    owners = _attribute_owners()
    assert _c_imports(text) == {"channel._session"}
    assert _c_attributes(text) == {"_book", "holder", "acquire", "_memptr"}
    found = _c_attribute_violations("_fastpath", _c_attributes(text), owners)
    assert "_fastpath (driver) touches .holder, defined only above" in found  # the peer's
    assert "_fastpath (driver) touches ._book, defined only above" in found  # the channel's
    # a real source with these lines added: the channel's code reads the pool's private
    real = _c_sources()["_engine"] + text
    found = _c_attribute_violations("_engine", _c_attributes(real), owners)
    assert "_engine (engine) touches the private ._memptr of another layer" in found
    assert "_engine (engine) touches ._book, defined only above" in found  # the channel's
    assert not any(".acquire" in f for f in found)  # the pool's own acquire, and a lock's


def test_compiled_code_touches_no_attribute_of_a_higher_layer() -> None:
    """The compiled modules import nothing above their layer (the graph's check above covers
    their PyImport calls) and read, write or call no attribute that only a higher layer
    defines, and no private attribute of another layer."""
    owners = _attribute_owners()
    found = set()
    for module, source in _c_sources().items():
        found |= _c_attribute_violations(module, _c_attributes(source), owners)
    assert found == set(), "compiled code breaks the layers"


# ----------------------------------------------------------- descriptor pickles


@pytest.fixture
def exporter_fds() -> Iterator[list[int]]:
    fds = [os.memfd_create(f"cupy-ipcpool-pickle-{i}") for i in range(3)]
    yield fds
    for fd in fds:
        os.close(fd)


def test_plain_pickles_of_a_descriptor_keep_no_fds(exporter_fds: list[int]) -> None:
    desc = PoolDescriptor(
        pool_id=b"p" * 16,
        exporter_pid=os.getpid(),
        exporter_start_time=1,
        exporter_uid=os.geteuid(),
        device_uuid=b"u" * 16,
        device_ordinal=0,
        num_slots=len(exporter_fds),
        slot_nbytes=4096,
        alloc_nbytes=4096,
        fds=tuple(exporter_fds),
    )
    before = open_fds()
    blobs = [pickle.dumps(desc) for _ in range(50)]
    assert not fds_opened_since(before)  # nothing duplicated for the 50 pickles
    back = pickle.loads(blobs[0])
    assert back == desc and back.take_local_fds() is None  # the peer fetches them itself
    del blobs, back
    assert not fds_opened_since(before)
    # multiprocessing (Process arguments, Queue.put) still sends the fds:
    # tests/test_handles.py::test_pickle_through_queue and friends
