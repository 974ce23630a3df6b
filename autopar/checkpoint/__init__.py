"""Sharded checkpoints (api.md "Checkpoints"): every rank writes and reads only its own pieces of the
model's state through ``torch.distributed.checkpoint``, described against the full tensors so that a
checkpoint saved under one plan loads under any other (``autopar.checkpoint.store``)."""

__all__: list[str] = []
