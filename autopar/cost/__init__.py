"""Step 2, the one cost model: what any piece of a plan costs in time and memory on a cluster.

- ``comm``: alpha-beta times of point-to-point transfers and collectives;
- ``profile``, ``step``, ``probe``: the per-block time tables (measured, emulated, roofline) and the
  optimizer / per-call terms, read as ``autopar.ir.ModelCosts``;
- ``tp``: tensor-parallel members (work factors, all-reduces);
- ``memory``: the one stage-memory-per-rank formula and the data-parallel rank memory;
- ``stage``: the one stage cost tensor both the pipeline and the joint planner split with;
- ``pipeline``, ``joint``: what a built pipeline costs (stage durations, the simulated step) and the
  joint planner's member loads, both over ``stage`` and ``memory``;
- ``measure_cache``: the on-disk cache of measured tables.

Nothing here imports the planner or the runtime.
"""

__all__: list[str] = []
