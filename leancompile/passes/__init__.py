"""Compiler passes over the traced rollout and update programs.

Analyses are functions over the traced programs that record what they found in ``node.meta`` (keys in
:mod:`leancompile.passes.meta`) and return a small frozen result; rewrites change one graph in place and return how
many nodes they changed. :mod:`leancompile.passes.pipeline` holds the order in which they run, checks every graph
after each pass and records what each did.
"""
from .shared import SharedBackbone, detect_shared_backbone
from .capture import BackboneCall, Programs, capture
from .provisional import capture_provisional
from .gradients import GradientNeed, prune_gradient_need
from .identities import drop_copies_of_unshared_values, drop_multiplications_by_one, fold_views
from .inplace import write_scatters_in_place
from .linearity import Linearity, check_linearity
from .matmul_order import order_matrix_products
from .rewrite import RewrittenPrograms, rewrite_for_retain
from .pipeline import ONE_ROW_PARTITION, TRACED_ROWS, Pass, PassError, PassHistory, PassRecord
from .rowwise import fold_per_row_calls, prepare_for_rows, random_operators, sum_products_over_rows
from .validity import Validity, check_validity

__all__ = [
    "BackboneCall",
    "GradientNeed",
    "Linearity",
    "Programs",
    "ONE_ROW_PARTITION",
    "Pass",
    "PassError",
    "PassHistory",
    "PassRecord",
    "TRACED_ROWS",
    "RewrittenPrograms",
    "SharedBackbone",
    "Validity",
    "capture",
    "capture_provisional",
    "check_linearity",
    "check_validity",
    "detect_shared_backbone",
    "drop_copies_of_unshared_values",
    "drop_multiplications_by_one",
    "fold_per_row_calls",
    "fold_views",
    "order_matrix_products",
    "prepare_for_rows",
    "prune_gradient_need",
    "random_operators",
    "rewrite_for_retain",
    "sum_products_over_rows",
    "write_scatters_in_place",
]
