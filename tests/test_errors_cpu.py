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
import gc
import inspect
import os
import pathlib
import pickle
from collections.abc import Iterator
from typing import Any

import pytest

import cupy_ipcpool as cip
from cupy_ipcpool import _errors
from cupy_ipcpool._arena import AllocationScope, SlotArena
from cupy_ipcpool._handles import ArrayHandle, PoolDescriptor
from cupy_ipcpool._slots import SlotTable
from cupy_ipcpool._vmm import UndoStack, round_up

PACKAGE = pathlib.Path(cip.__file__).parent


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


# --------------------------------------------------------------- import layers

#: The layers of DESIGN.md, bottom first; a module may import its own layer and below.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("errors", ("_errors", "_version")),
    ("handles", ("_handles",)),
    ("driver", ("_driver", "_fastpath")),
    ("vmm", ("_vmm",)),
    ("transport", ("_transport",)),
    ("pool", ("_arrays", "_compiled", "_hotpath", "_slots", "_arena", "_pool")),
    ("peer", ("_peer",)),
    ("allocator", ("_allocator", "_compat")),
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
        "(and to the layer table of the README)"
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
                else:
                    yield target if target in modules else f"{target}.__init__".lstrip(".")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "cupy_ipcpool":
                    yield ".".join(parts[1:]) or "__init__"


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        graph[name] = {m for m in _imports(path) if m != name}
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


# ----------------------------------------------------------- descriptor pickles


@pytest.fixture
def exporter_fds() -> Iterator[list[int]]:
    fds = [os.memfd_create(f"cupy-ipcpool-pickle-{i}") for i in range(3)]
    yield fds
    for fd in fds:
        os.close(fd)


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


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
    gc.collect()
    before = _fd_count()
    blobs = [pickle.dumps(desc) for _ in range(50)]
    gc.collect()
    assert _fd_count() == before  # nothing duplicated for the 50 pickles
    back = pickle.loads(blobs[0])
    assert back == desc and back.take_local_fds() is None  # the peer fetches them itself
    del blobs, back
    gc.collect()
    assert _fd_count() == before
    # multiprocessing (Process arguments, Queue.put) still sends the fds:
    # tests/test_handles.py::test_pickle_through_queue and friends
