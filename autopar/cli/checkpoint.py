"""``autopar checkpoint inspect DIR`` and ``autopar checkpoint consolidate DIR OUT.safetensors``: read a
sharded checkpoint (``autopar.checkpoint``) without a job."""

from __future__ import annotations

import argparse
import math

__all__ = ["add_parser", "cmd_checkpoint"]


def add_parser(sub) -> None:
    c = sub.add_parser("checkpoint", help="inspect a sharded checkpoint or consolidate it into one safetensors file",
                       description="Read a checkpoint written by compiled.save (torch.distributed.checkpoint), "
                                   "without starting a job.")
    cs = c.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True)
    i = cs.add_parser("inspect", help="step, plan, files and every tensor (full shape, dtype, pieces)")
    i.add_argument("directory", metavar="DIR")
    o = cs.add_parser("consolidate", help="write the full model state to OUT.safetensors (for export)")
    o.add_argument("directory", metavar="DIR")
    o.add_argument("out", metavar="OUT.safetensors")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def cmd_checkpoint(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from autopar.checkpoint.inspect import consolidate, describe

    console = Console()
    if args.checkpoint_command == "consolidate":
        shapes = consolidate(args.directory, args.out)
        console.print(f"wrote {len(shapes)} tensors ({sum(math.prod(s) for s in shapes.values()):,} elements) "
                      f"to {args.out}", soft_wrap=True)
        return 0
    manifest, entries = describe(args.directory)
    console.print(f"checkpoint {manifest.path}: step {manifest.step}, saved by {manifest.meta.get('world_size', '?')}"
                  f" ranks, {len(manifest.files)} files, {_size(manifest.total_bytes)}", soft_wrap=True)
    if "strategy" in manifest.meta:
        console.print(f"plan: {manifest.meta['strategy']}", soft_wrap=True)
    table = Table("tensor", "shape", "dtype", "elements", "pieces")
    for e in entries:
        table.add_row(e.fqn, "x".join(map(str, e.shape)) or "scalar", e.dtype, f"{e.numel:,}", str(e.num_chunks))
    console.print(table)
    return 0
