"""The sanitizer lane itself (``CUPY_IPCPOOL_C_SANITIZE``, run by ``.ci/run``): a program
built the way the C tests build theirs, with a planted bug of each kind the lane's
sanitizers look for, fails its test with the sanitizer's report in the message.

Without the variable there is no lane to check: every test here is skipped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_c_library import SANITIZE, Probe, build_c_program

pytestmark = pytest.mark.skipif(
    not SANITIZE, reason="CUPY_IPCPOOL_C_SANITIZE is not set: no sanitizer lane to check"
)

#: A probe (one answer per line) with one planted bug per command.
BUGGY_C = r"""
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int shared;
static void *volatile kept;

static void *bump(void *arg)
{
    (void)arg;
    for (int i = 0; i < 1000; i++)
        shared++;
    return NULL;
}

int main(void)
{
    char line[256];
    setvbuf(stdout, NULL, _IOLBF, 0);
    while (fgets(line, sizeof line, stdin) != NULL) {
        line[strcspn(line, "\n")] = 0;
        if (!strcmp(line, "quit")) {
            break;
        } else if (!strcmp(line, "ping")) {
            printf("ok\n");
        } else if (!strcmp(line, "overflow")) {
            volatile size_t n = 8; /* a size UBSan's object-size check cannot see */
            char *p = malloc(n);
            printf("ok %d\n", p[n]);
            free(p);
        } else if (!strcmp(line, "signed")) {
            volatile int big = 0x7fffffff;
            printf("ok %d\n", big + 1);
        } else if (!strcmp(line, "leak")) {
            kept = malloc(100);
            kept = NULL;
            printf("ok\n");
        } else if (!strcmp(line, "race")) {
            pthread_t a, b;
            pthread_create(&a, NULL, bump, NULL);
            pthread_create(&b, NULL, bump, NULL);
            pthread_join(a, NULL);
            pthread_join(b, NULL);
            printf("ok %d\n", shared);
        } else {
            printf("err unknown\n");
        }
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def buggy_exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("csan") / "buggy.c"
    src.write_text(BUGGY_C)
    return build_c_program(src.parent, "buggy", [src], library=False)


@pytest.fixture
def buggy(buggy_exe: Path) -> Iterator[Probe]:
    p = Probe(buggy_exe)
    try:
        yield p
    finally:
        if p.proc.stdin is not None and not p.proc.stdin.closed:
            with contextlib.suppress(AssertionError):  # the test failed before its close
                p.close()


def needs(kind: str) -> None:
    if kind not in SANITIZE.split(","):
        pytest.skip(f"CUPY_IPCPOOL_C_SANITIZE={SANITIZE} has no {kind}")


def test_a_clean_program_passes(buggy: Probe) -> None:
    assert buggy("ping") == "ok"
    buggy.close()


def test_a_heap_overflow_fails_with_the_report(buggy: Probe) -> None:
    needs("address")
    with pytest.raises(AssertionError, match=r"(?s)heap-buffer-overflow.*buggy\.c:"):
        buggy("overflow")
    with pytest.raises(AssertionError, match="exited"):
        buggy.close()


def test_undefined_behaviour_fails_with_the_report(buggy: Probe) -> None:
    needs("undefined")
    with pytest.raises(AssertionError, match=r"buggy\.c:\d+:\d+: runtime error: signed integer"):
        buggy("signed")
    with pytest.raises(AssertionError, match="exited"):
        buggy.close()


def test_a_leak_fails_the_close_with_the_report(buggy: Probe) -> None:
    needs("address")
    assert buggy("leak") == "ok"
    with pytest.raises(AssertionError, match=r"(?s)LeakSanitizer: detected memory leaks.*buggy\.c"):
        buggy.close()


def test_a_data_race_fails_the_close_with_the_report(buggy: Probe) -> None:
    needs("thread")
    assert buggy("race").startswith("ok ")
    with pytest.raises(AssertionError, match=r"(?s)ThreadSanitizer: data race.*buggy\.c"):
        buggy.close()
