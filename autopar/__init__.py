"""autopar: a compiled-graph auto-parallelizer for training PyTorch models on heterogeneous clusters.

Public surface (see shared/spec/api.md): ``Cluster``, ``plan``, ``compile``, ``launch``, ``init``,
``Plan``, ``PlanConfig``, ``Pin``, ``RunConfig``, ``Inputs`` and ``Derived`` (keyword, pytree and per-batch model inputs), ``materialize``, ``models``, ``kernels``, ``passes``,
``current_cluster`` and ``restart_count`` (elastic runs), and the errors
``AutoparError`` (the base, a ``ValueError``), ``ClusterError``, ``PlanError``, ``RuntimeInputError``,
``LaunchError``.
Submodules are imported lazily so ``import autopar`` stays cheap and does nothing at import time.
"""

from importlib import import_module

from autopar.errors import AutoparError, ClusterError, LaunchError, PlanError, RuntimeInputError

__all__ = [
    "AutoparError", "ClusterError", "PlanError", "RuntimeInputError", "LaunchError",
    "Cluster", "Plan", "PlanConfig", "Pin", "RunConfig", "Inputs", "Derived", "plan", "compile", "launch", "init", "models", "kernels",
    "passes", "materialize", "current_cluster", "restart_count",
]

_LAZY = {
    "Cluster": ("autopar.cluster.model", "Cluster"),
    "Plan": ("autopar.ir.plan", "Plan"),
    "plan": ("autopar.api", "plan"),
    "compile": ("autopar.compiling", "compile"),
    "launch": ("autopar.runtime.launcher", "launch"),
    "init": ("autopar.runtime.launcher", "init"),
    "models": ("autopar.models", None),
    "kernels": ("autopar.kernels", None),
    "passes": ("autopar.passes", None),
    "PlanConfig": ("autopar.config", "PlanConfig"),
    "Pin": ("autopar.config", "Pin"),
    "RunConfig": ("autopar.config", "RunConfig"),
    "Inputs": ("autopar.ir.inputs", "Inputs"),
    "Derived": ("autopar.ir.inputs", "Derived"),
    "materialize": ("autopar.lowering.materialize", "materialize"),
    "current_cluster": ("autopar.runtime.elastic", "current_cluster"),
    "restart_count": ("autopar.runtime.elastic", "restart_count"),
}


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        mod = import_module(module)
        return mod if attr is None else getattr(mod, attr)
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
