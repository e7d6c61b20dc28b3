"""Skip markers shared by the CPU-tier tests."""

from __future__ import annotations

import pytest

from cupy_ipcpool import CudaUnavailableError, _driver
from cupy_ipcpool.remote import _ucx as ucx


def has_driver() -> bool:
    """True when a CUDA driver can be initialised here."""
    try:
        _driver.driver_module()
    except CudaUnavailableError:
        return False
    return True


#: For tests of the no-driver behaviour: they cannot run where a driver exists.
no_driver = pytest.mark.skipif(has_driver(), reason="a CUDA driver is present on this machine")

#: For tests that need UCXX working (the remote extra installed, its UCX libraries loaded).
needs_ucx = pytest.mark.skipif(
    ucx.available() is not None, reason=f"the remote extra is not installed: {ucx.available()}"
)
