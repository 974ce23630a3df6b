"""The pure planner run on this machine: what ``autopar.plan``, ``compile`` and the CLI hand
``autopar.planner.entry.plan_with_config`` besides the tables, so that the planner itself opens no
file, starts no process and reads no clock.

- ``side_bounds``: the bounds' searches in side processes beside the main search (``bounds=``);
- ``plan_cache``: the joint planner's plans on disk (``cache=``).

The clock (``clock=``) is ``time.perf_counter``.
"""

__all__: list[str] = []
