"""The command line run in a child forked from the tests' forkserver, as ``python -m`` runs it.

``python -m cupy_ipcpool ARGV`` is a fresh interpreter that imports the
package and calls :func:`cupy_ipcpool.__main__.main`: about 0.6 s of imports
per run, for a test that checks one line of output.  :func:`run` gives the
same process-level result (exit status, every byte written to fds 1 and 2,
the environment it names, the exit of an uncaught exception with its
traceback) from a child forked off a server that imported the package once.
``tests/test_cli_cpu.py`` compares the two on a sample of commands.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import traceback

from tests._pipe_child import CHILDREN

#: ``sys.argv[0]`` of ``python -m cupy_ipcpool``: the package's ``__main__.py``
MAIN_FILE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "cupy_ipcpool", "__main__.py")


def _main(argv: list[str], env: dict[str, str], out: str, err: str) -> None:
    """The child: ``sys.exit(main())`` with ``env`` as its environment, fds 1 and 2 to files."""
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [MAIN_FILE, *argv]
    code: object
    try:
        from cupy_ipcpool.__main__ import main

        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("text"): the text on stderr, status 1
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """What ``subprocess.run([python, "-m", "cupy_ipcpool", *argv], env=env, ...)`` returns.

    Its output captured as text; :class:`subprocess.TimeoutExpired` after ``timeout`` s.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        for path in (out, err):
            open(path, "w").close()
        proc = CHILDREN.Process(target=_main, args=(list(argv), env, out, err))
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join(5)
            raise subprocess.TimeoutExpired([sys.executable, "-m", "cupy_ipcpool", *argv], timeout)
        with open(out) as f_out, open(err) as f_err:
            stdout, stderr = f_out.read(), f_err.read()
    return subprocess.CompletedProcess(
        [sys.executable, "-m", "cupy_ipcpool", *argv], proc.exitcode, stdout, stderr
    )
