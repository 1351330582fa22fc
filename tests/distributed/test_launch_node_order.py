"""Nodes of one job start in any order: ``overdrive launch`` on a node other than 0 waits for node 0's master port
while nothing listens there yet, as torchrun's ranks do, instead of stopping the job ("not reachable ... start node 0
first") when it happened to come up a moment before node 0 (``srun`` starts every node at once)."""

from __future__ import annotations

import socket
import threading

import pytest

from overdrive._utils.errors import OverdriveError
from overdrive.distributed import doctor
from overdrive.distributed.config import LaunchConfig
from overdrive.distributed.launch import preflight


def test_check_master_waits_for_a_port_that_starts_listening() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, not listening: connection refused, as before node 0's store opens
        port = s.getsockname()[1]
        calls: list[int] = []

        def node0_starts() -> None:  # called once, before the first retry
            calls.append(1)
            s.listen()

        found = doctor.check_master("127.0.0.1", port, node_rank=1, wait_s=30, on_wait=node0_starts)
        assert calls == [1]
        assert [(f.level, f.what) for f in found] == [("info", "MASTER_PORT")], found
    # without waiting, the same refusal is an error that says what it means
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        found = doctor.check_master("127.0.0.1", s.getsockname()[1], node_rank=1)
        assert found[0].level == "error" and "nothing listens" in found[0].detail


def test_launch_on_node_1_started_before_node_0(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        cfg = LaunchConfig(nnodes=2, node_rank=1, master_addr="127.0.0.1", master_port=port)
        with pytest.raises(OverdriveError, match=f"nothing listens on 127.0.0.1:{port}"):
            preflight(cfg, env={}, master_wait_s=0)
        node0 = threading.Timer(0.3, s.listen)  # node 0's launch opens the port a moment later
        node0.start()
        try:
            report = preflight(cfg, env={}, master_wait_s=60)
        finally:
            node0.cancel()
        assert any(f["what"] == "MASTER_PORT" and f["level"] == "info" for f in report["findings"])
        assert "waiting up to 60 s for node 0" in capsys.readouterr().err
