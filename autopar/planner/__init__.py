"""Step 3, partitioning: pure functions of (cost tables, cluster, config) that return a ``Plan``.

- ``allocate``: the exact uneven batch allocator; ``dp``: data parallel + ZeRO 0-3 (Poplar);
- ``pp``: pipeline stages across device types (HETHUB); ``layouts``: tensor-parallel member layouts;
- ``joint``: the joint search over pipeline x tensor x data parallel (``plan_auto``);
- ``bounds``: the one definition of the upper and compute bounds; ``cache``: the plan cache's key;
- ``entry``: ``plan_with_config``, the one entry point (a ``PlanConfig`` in, a ``Plan`` with its bounds out).

What a plan costs (stage cost tensor, memory, durations) is ``autopar.cost``'s; this package searches.
Pure: the planner opens no file, starts no process and reads no clock or environment variable; the
side processes of the bounds, the plans on disk and the clock are handed in by ``autopar.planning``.
"""

__all__: list[str] = []
