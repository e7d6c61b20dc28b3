"""CPU tier: the remote bench lane's command line, in host memory over UCX on loopback.

It runs every lane with each transport set asked for (``--tls``, ``UCX_TLS``
restored after) and writes the figures that docs/bench commits (``--json``).
"""

from __future__ import annotations

import json
import os

import pytest

from cupy_ipcpool._bench import remote
from tests.skips import needs_ucx


@needs_ucx
def test_the_lane_runs_each_transport_set_and_writes_its_figures(tmp_path, monkeypatch):
    # raw UCXX and the TCP socket (the channel's lane, a server and a subscriber, is
    # tests/test_remote_cpu.py's business): the command line and the figures are the same
    monkeypatch.setattr(remote, "LANES", {"ucxx": remote._ucxx, "tcp": remote._tcp})
    monkeypatch.setenv("UCX_TLS", "tcp")
    out = tmp_path / "remote.json"
    out.write_text(json.dumps({"memory": {"device": {"1MiB": {"ucxx": 1.0}}}}))  # another run
    argv = ["--sizes", "1", "--repeats", "1", "--budget-mib", "8", "--json", str(out)]
    assert remote.main([*argv, "--tls", "default", "--tls", "tcp"]) == 0
    assert os.environ["UCX_TLS"] == "tcp"  # put back as it was
    figures = json.loads(out.read_text())
    # each transport set under its own key, beside the run that was there
    assert sorted(figures["memory"]) == ["device", "host", "host_tcp"]
    assert figures["memory"]["device"] == {"1MiB": {"ucxx": 1.0}}
    for key in ("host", "host_tcp"):
        lanes = figures["memory"][key]["1MiB"]
        assert sorted(lanes) == ["tcp", "tcp_over_ucxx", "ucxx"]
        assert lanes["tcp_over_ucxx"] == pytest.approx(lanes["ucxx"] / lanes["tcp"])
        assert figures["frames"][f"{key}_1MiB"] == 8
        for lane in ("ucxx", "tcp"):
            assert lanes[lane] > 0  # seconds per frame
            gbps = figures["gbps"][f"{key}_1MiB_{lane}"]
            assert gbps == pytest.approx((1 << 20) / lanes[lane] / 1e9)


def test_default_tls_means_unset_inside_and_comes_back(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "rc")
    with remote.with_tls(remote.DEFAULT_TLS):
        assert "UCX_TLS" not in os.environ
    assert os.environ["UCX_TLS"] == "rc"
    monkeypatch.delenv("UCX_TLS")
    with remote.with_tls("tcp,cuda_copy"):
        assert os.environ["UCX_TLS"] == "tcp,cuda_copy"
    assert "UCX_TLS" not in os.environ
