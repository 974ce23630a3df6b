"""The measurement layer: every timing, emulation probe, link sweep and calibration of this machine,
and their on-disk caches. It produces the tables the pure cost model (``autopar.cost``) and planner
(``autopar.planner``) take as arguments; neither of those imports it.

- ``blocks``: block times in situ; ``step``: the optimizer rate and the call terms; ``loss``: the
  loss's time; ``engine_call``: an emulated engine call's cold start and the memory meter's price;
  ``tp``: the tensor-parallel rewrite's replicated fraction, timed;
- ``links``: the gloo link between emulated ranks; ``machine``: this machine's calibration and link
  attached to a cluster;
- ``tables``: ``model_costs``, what ``autopar.plan``, ``compile`` and the CLI call;
- ``cache``: where all of it is kept (``$AUTOPAR_CACHE_DIR``).
"""

__all__: list[str] = []
