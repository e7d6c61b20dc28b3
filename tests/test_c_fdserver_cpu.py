"""The fd server (``c/src/fdserver.c``) and its client (``c/src/fetch.c``), from a plain C
program: ``c/tests/cip_fdserver_probe.c`` serves 300 memfds (two SCM_RIGHTS batches) and
fetches them from several threads at once, every fd's content checked, a wrong token
refused, a half request forgotten.  The Python ``FdServer`` and ``fetch_fds`` run the same
code (the transport tests); here it runs where the sanitizer lanes can watch it
(.ci/run: ASan + UBSan, and ThreadSanitizer for the server's thread).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from test_c_library import C_DIR, build_c_program


@pytest.fixture(scope="module")
def probe_exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_c_program(
        tmp_path_factory.mktemp("cfdserver"),
        "cip_fdserver_probe",
        [C_DIR / "tests" / "cip_fdserver_probe.c"],
    )


@pytest.mark.parametrize(("clients", "rounds"), [(1, 3), (8, 10)])
def test_the_fd_server_serves_many_clients_at_once_and_gives_back_every_fd(
    probe_exe: Path, tmp_path: Path, clients: int, rounds: int
) -> None:
    """Every fetch gets all 300 fds in order; the server counts no connection once the
    clients are done, and once freed it holds no fd (the served ones are the caller's)."""
    done = subprocess.run(
        [str(probe_exe), str(tmp_path), str(clients), str(rounds)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Sanitizer" not in done.stderr, done.stderr
    word, before, after, live = done.stdout.split()
    assert word == "ok" and before == after and live == "0", done.stdout
    assert not (tmp_path / "fds.sock").exists()
