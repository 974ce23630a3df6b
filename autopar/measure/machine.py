"""This machine's measured facts attached to a cluster for planning: its calibration factors (profile
cache, ``autopar.measure.cache.load_calibration``) and the gloo link measured between its emulated
ranks (``autopar.measure.links.emulated_link_for``), through the pure
``autopar.cost.calibrate.calibrated_cluster``. ``autopar.plan``, ``compile`` and ``compiled.profile()``
price a run with this cluster."""

from __future__ import annotations

__all__ = ["machine_cluster"]


def machine_cluster(cluster):
    """``cluster`` with this machine's calibration factors and measured emulated link attached (the same
    object when there is nothing to attach). May measure the link once per machine (forked gloo
    processes, ``autopar.measure.links``); reads the environment's emulation settings."""
    from autopar.cluster.emulation import emulation_time_scale
    from autopar.cost.calibrate import calibrated_cluster
    from autopar.measure.cache import load_calibration
    from autopar.measure.links import emulated_link_for

    return calibrated_cluster(cluster, load_calibration(), time_scale=emulation_time_scale(len(cluster)),
                              link=emulated_link_for(cluster))
