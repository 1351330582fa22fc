"""Typed configs for distributed training: the strategy (DDP / FSDP2) and the launcher (torchrun)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from overdrive._utils.config import ConfigBase
from overdrive._utils.errors import UsageError

STRATEGIES = ("none", "ddp", "fsdp")


@dataclass(frozen=True)
class Strategy(ConfigBase):
    """How the model is spread over ranks.

    ``kind="ddp"``: DistributedDataParallel with ``bucket_cap_mb``, ``gradient_as_bucket_view``,
    ``static_graph``, ``find_unused_parameters``. ``kind="fsdp"``: FSDP2 ``fully_shard`` on each
    block (children of ``nn.ModuleList``/``nn.Sequential`` containers, or modules whose class name
    is in ``fsdp_blocks``), then the root; ``reshard_after_forward`` as in FSDP2.

    Example:
        >>> Strategy.from_name("ddp").bucket_cap_mb
        25.0
        >>> Strategy.from_json(DDP.to_json()) == DDP
        True
    """

    kind: Literal["none", "ddp", "fsdp"] = "ddp"
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True
    reshard_after_forward: bool = True
    fsdp_blocks: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in STRATEGIES:
            raise UsageError(f"strategy kind={self.kind!r} is not one of {STRATEGIES}")
        if not self.bucket_cap_mb > 0:
            raise UsageError(f"bucket_cap_mb={self.bucket_cap_mb} must be > 0 (DDP's default is 25)")
        if self.static_graph and self.find_unused_parameters:
            raise UsageError("static_graph=True and find_unused_parameters=True exclude each other; pick one")
        object.__setattr__(self, "fsdp_blocks", tuple(self.fsdp_blocks))

    @classmethod
    def from_name(cls, name: str | Strategy) -> Strategy:
        if isinstance(name, Strategy):
            return name
        key = str(name).lower()
        if key not in PRESETS:
            raise UsageError(f"strategy={name!r} is not one of {sorted(PRESETS)}; use 'ddp' or 'fsdp'")
        return PRESETS[key]


NONE = Strategy(kind="none")
DDP = Strategy(kind="ddp")
DDP_STATIC = Strategy(kind="ddp", static_graph=True)
FSDP = Strategy(kind="fsdp")
PRESETS: dict[str, Strategy] = {"none": NONE, "ddp": DDP, "ddp_static": DDP_STATIC, "fsdp": FSDP}


@dataclass(frozen=True)
class LaunchConfig(ConfigBase):
    """What ``overdrive launch`` hands to torchrun (torch.distributed.run).

    Single node without a master address: ``--standalone`` (torchrun picks a free port).
    With ``rdzv_endpoint``: c10d rendezvous (elastic, any node may host it); else static
    MASTER_ADDR/MASTER_PORT.

    Example:
        >>> LaunchConfig(nproc_per_node=2, max_restarts=1).torchrun_args()[:4]
        ['--nnodes', '1', '--nproc-per-node', '2']
    """

    nnodes: int = 1
    nproc_per_node: int | str = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str = "overdrive"
    max_restarts: int = 0
    monitor_interval: float = 0.1

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise UsageError(f"nnodes={self.nnodes} must be >= 1")
        if isinstance(self.nproc_per_node, str):
            if self.nproc_per_node not in ("gpu", "cpu", "auto"):
                raise UsageError(f"nproc_per_node={self.nproc_per_node!r}: give a number or 'gpu'/'cpu'/'auto'")
        elif self.nproc_per_node < 1:
            raise UsageError(f"nproc_per_node={self.nproc_per_node} must be >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise UsageError(f"node_rank={self.node_rank} must be in [0, nnodes={self.nnodes})")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise UsageError(f"master_port={self.master_port} is not a TCP port (1-65535)")
        if self.max_restarts < 0:
            raise UsageError(f"max_restarts={self.max_restarts} must be >= 0")
        if self.master_addr is not None:  # [fd00::1] as torch's store takes it; a host:port refused naming the fix
            from overdrive.distributed.doctor import master_host

            object.__setattr__(self, "master_addr", master_host(self.master_addr, "--master-addr"))
        if self.nnodes > 1 and self.master_addr is None and self.rdzv_endpoint is None:
            raise UsageError(
                f"nnodes={self.nnodes} needs --master-addr (static) or --rdzv-endpoint host:port (elastic) "
                "so the nodes can find each other"
            )
        if self.rdzv_endpoint is not None and (self.master_addr is not None or self.master_port is not None):
            # torchrun's c10d rendezvous ignores them: the job waited on the endpoint and failed after a minute or so
            raise UsageError(f"--rdzv-endpoint {self.rdzv_endpoint} (elastic rendezvous) and --master-addr/--master-port "
                             "(static) are two ways for the nodes to meet; give one of them")
        if self.rdzv_endpoint is not None:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise UsageError(f"rdzv_endpoint={self.rdzv_endpoint!r} must be host:port with a TCP port 1-65535 "
                                 "(for example node0:29400)")

    @property
    def standalone(self) -> bool:
        return self.nnodes == 1 and self.master_addr is None and self.rdzv_endpoint is None

    def torchrun_args(self) -> list[str]:
        args = ["--nnodes", str(self.nnodes), "--nproc-per-node", str(self.nproc_per_node),
                "--max-restarts", str(self.max_restarts), "--monitor-interval", str(self.monitor_interval)]
        if self.standalone:
            args.append("--standalone")
        elif self.rdzv_endpoint is not None:
            args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", self.rdzv_endpoint, "--rdzv-id", self.rdzv_id]
        else:
            args += ["--node-rank", str(self.node_rank), "--master-addr", str(self.master_addr),
                     "--master-port", str(self.master_port or 29500)]
        return args
