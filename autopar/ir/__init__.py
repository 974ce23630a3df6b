"""The plain data that passes between the steps: cost tables (``ModelCosts``), plans (``Plan``,
``Stage``, ``Predicted``) and pipeline schedules with their simulator. Frozen values with a JSON
round trip; nothing here imports another step."""

from autopar.ir.costs import ModelCosts
from autopar.ir.plan import Plan, Predicted, Stage

__all__ = ["ModelCosts", "Plan", "Predicted", "Stage"]
