"""``overdrive launch``: torchrun with the doctor's quick checks first."""

from __future__ import annotations

import sys

import click


@click.command("launch", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--nnodes", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--nproc-per-node", default="1", show_default=True, help="Processes per node: a number, or 'gpu' (one per GPU).")
@click.option("--node-rank", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--master-addr", default=None, help="Static rendezvous: node 0's address.")
@click.option("--master-port", type=click.IntRange(1, 65535), default=None, help="Static rendezvous port (default 29500).")
@click.option("--rdzv-endpoint", default=None, help="Elastic c10d rendezvous host:port (instead of --master-addr).")
@click.option("--max-restarts", type=click.IntRange(min=0), default=0, show_default=True, help="Restart all workers this often after a failure. On one node each restart is a fresh torchrun, so "
                   "plain dist.init_process_group() scripts rejoin; across nodes restarts are torchrun's and need "
                   "overdrive.distributed.init().")
@click.option("--no-check", is_flag=True, help="Skip the doctor's quick checks.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Stop the whole job (every rank, restarts included) after this many seconds; exit 1 saying so.")
@click.option("-m", "--module", "module", is_flag=True, help="SCRIPT is a module name (python -m SCRIPT), as torchrun's -m.")
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def command(nnodes: int, nproc_per_node: str, node_rank: int, master_addr: str | None, master_port: int | None,
            rdzv_endpoint: str | None, max_restarts: int, no_check: bool, timeout_s: float | None, module: bool,
            script: str, script_args: tuple[str, ...]) -> None:
    """Run SCRIPT on every rank with torchrun; resumable training restarts under --max-restarts.

    \b
    Example:
      overdrive launch --nproc-per-node 8 --max-restarts 2 train.py --epochs 90
      overdrive launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --nproc-per-node gpu train.py
      overdrive launch --nproc-per-node 2 -m mypkg.train --lr 0.1
      overdrive launch --nproc-per-node 4 --timeout 3600 train.py   # a hung rank cannot hold the job
    """
    from overdrive.distributed.config import LaunchConfig
    from overdrive.distributed.launch import launch

    from overdrive._utils.errors import UsageError

    nproc: int | str = int(nproc_per_node) if nproc_per_node.isdigit() else nproc_per_node
    if nproc == 0 or (isinstance(nproc, str) and nproc not in ("gpu", "cpu", "auto")):
        raise UsageError(f"--nproc-per-node {nproc_per_node}: give a number of processes >= 1, or gpu (one per GPU), "
                         "cpu or auto")
    if node_rank >= nnodes:
        raise UsageError(f"--node-rank {node_rank} with --nnodes {nnodes}: node ranks run 0 to {nnodes - 1}")
    cfg = LaunchConfig(nnodes=nnodes, nproc_per_node=nproc, node_rank=node_rank, master_addr=master_addr,
                       master_port=master_port, rdzv_endpoint=rdzv_endpoint, max_restarts=max_restarts)
    rc = launch(cfg, script, list(script_args), module=module, check=not no_check, timeout_s=timeout_s)
    if rc != 0:  # torchrun's own report ends in a Python traceback of its own (ChildFailedError): close with one line
        from overdrive._utils.errors import OverdriveError

        tried = f" in each of {max_restarts + 1} attempts" if max_restarts else ""
        raise OverdriveError(f"{script} failed{tried} (torchrun exit code {rc}) and every rank was stopped; the first "
                             "rank to fail is named under 'Root Cause' in torchrun's report above, its own error before it")
    sys.exit(0)
