"""Credit estimators (issue 4): pure functions ``(TreeArrays, Params) -> Credit`` by name.

Importing this package registers every estimator in ``ESTIMATORS``.
"""

# Estimator modules register themselves on import (one line each, kept sorted).
from train.credit import caliper as caliper  # "caliper" (METHODS C4-C8)
from train.credit import dsc as dsc  # "dsc" (METHODS D3-D5; gate D7-D10 in dsc_gate)
from train.credit import elpo as elpo  # "elpo" (METHODS E3-E8)
from train.credit import factor as factor  # "factor" (METHODS F1-F5)
from train.credit import grpo as grpo  # "grpo" (METHODS G1)
from train.credit import sgcd as sgcd  # "sgcd" (METHODS Q1-Q5)
from train.credit import slca as slca  # "slca" (METHODS S1, S5, S6)
from train.credit import trace as trace  # "trace" (METHODS T1-T7)
from train.credit import tree_grpo as tree_grpo  # "tree_grpo" (METHODS G9-G11)
from train.credit.base import ESTIMATORS, Credit, Estimator, Params, TreeArrays, register

__all__ = ["ESTIMATORS", "Credit", "Estimator", "Params", "TreeArrays", "register"]
