"""Step 2, the one cost model: what any piece of a plan costs in time and memory on a cluster, as pure
functions of the model's facts, the time tables and the cluster.

- ``comm``: alpha-beta times of point-to-point transfers and collectives;
- ``profile``: the per-block time tables from given measurements (or the roofline) and the
  ``ModelCosts`` they make; ``step``: the GPU optimizer rate and the predicted phases of a plan;
- ``tp``, ``tp_fwd``, ``tp_tables``: tensor-parallel members (work factors, collectives, overlap);
- ``memory``: the one stage-memory-per-rank formula and the data-parallel rank memory;
- ``stage``: the one stage cost tensor both the pipeline and the joint planner split with;
- ``pipeline``, ``joint``: what a built pipeline costs (stage durations, the simulated step) and the
  joint planner's member loads, both over ``stage`` and ``memory``;
- ``calibrate``: correction factors fitted from step profiles, applied to tables and links.

Pure: nothing here times, opens a file, starts a process or thread, or reads the environment or a
clock (``tests/test_layering.py`` reads the source to keep it so). What is measured on this machine
comes from ``autopar.measure`` as arguments. Nothing here imports the planner or the runtime.
"""

__all__: list[str] = []
