"""MASTER_ADDR as users write it: an IPv6 address in brackets (as in ``[fd00::1]:29500``) joins like the bare one,
and what no host can be (a ``host:port``, unbalanced brackets) is one clear error, not the store's 300 s timeout."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist

from overdrive import distributed as odist
from overdrive._utils.errors import UsageError
from overdrive.distributed.doctor import check_master, master_host


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("addr, host", [("[fd00::1]", "fd00::1"), ("fd00::1", "fd00::1"), (" node0 ", "node0"),
                                        ("10.0.0.1", "10.0.0.1"), ("[fe80::1%eth0]", "fe80::1%eth0")])
def test_master_host_takes_the_brackets_off(addr: str, host: str) -> None:
    assert master_host(addr) == host


@pytest.mark.parametrize("addr, says", [("10.0.0.1:29500", "MASTER_PORT=29500"), ("node0:80", "MASTER_ADDR=node0"),
                                        ("[::1", "not a host name"), ("[node0]", "not a host name"),
                                        ("", "not a host name")])
def test_master_host_refuses_what_no_host_can_be(addr: str, says: str) -> None:
    with pytest.raises(UsageError, match="MASTER_ADDR=") as exc:
        master_host(addr)
    assert says in str(exc.value)


def test_the_doctor_reports_a_host_port_master_addr() -> None:
    (f,) = check_master("10.0.0.1:29500", 29500)
    assert f.level == "error" and "MASTER_PORT=29500" in f.detail


@pytest.fixture
def hosts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The hosts init hands to torch's store; one it cannot resolve fails at once instead of after its timeout."""
    real = dist.TCPStore
    seen: list[str] = []

    def store(host: str, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append(host)
        if host.startswith("[") or host.count(":") == 1:  # the store resolves neither and waits out its timeout
            raise RuntimeError(f"the store was given {host!r}")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(dist, "TCPStore", store)
    monkeypatch.setenv("MASTER_PORT", str(odist.free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    return seen


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this host")
def test_init_joins_with_a_bracketed_ipv6_master_addr(hosts: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "[::1]")
    env = odist.init(backend="gloo", device="cpu")
    try:
        assert hosts == ["::1"] and env.world_size == 1 and dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()


def test_init_refuses_a_master_addr_with_a_port(hosts: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1:29500")
    with pytest.raises(UsageError, match="holds a port"):
        odist.init(backend="gloo", device="cpu")
    assert hosts == [] and not dist.is_initialized()


def test_launch_hands_torchrun_the_master_host_without_brackets() -> None:
    # `overdrive launch --master-addr "[fd00::1]"` went to torchrun as typed, whose store cannot read the brackets
    from overdrive._utils.errors import UsageError
    from overdrive.distributed.config import LaunchConfig

    cfg = LaunchConfig(nnodes=2, node_rank=1, master_addr="[fd00::1]", master_port=29500)
    assert cfg.master_addr == "fd00::1"
    with pytest.raises(UsageError, match=r"--master-addr='10.0.0.1:29500' holds a port.*MASTER_PORT=29500"):
        LaunchConfig(nnodes=2, master_addr="10.0.0.1:29500")
