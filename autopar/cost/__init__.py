"""Step 2, the one cost model: what any piece of a plan costs in time and memory on a cluster.

- ``comm``: alpha-beta times of point-to-point transfers and collectives;
- ``profile``, ``step``, ``probe``: the per-block time tables (measured, emulated, roofline) and the
  optimizer / per-call terms, read as ``autopar.ir.ModelCosts``;
- ``tp``: tensor-parallel members (work factors, all-reduces);
- ``pipeline``, ``joint``: stage durations, stage memory and the stage cost tensor that every planner
  and the bounds share.

Nothing here imports the planner or the runtime.
"""

__all__: list[str] = []
