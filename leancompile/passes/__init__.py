"""Compiler passes over the traced rollout and update programs.

Each pass is a function over FX graphs that records what it found in ``node.meta`` (keys in
:mod:`leancompile.passes.meta`) and returns a small frozen result. :func:`run` applies them in order and lints
every graph after each.
"""
from .backbone import SharedBackbone, detect_shared_backbone
from .capture import BackboneCall, Programs, capture, capture_provisional
from .gradients import GradientNeed, prune_gradient_need
from .identities import drop_copies_of_unshared_values, drop_multiplications_by_one
from .inplace import write_scatters_in_place
from .linearity import Linearity, check_linearity
from .matmul_order import order_matrix_products
from .rewrite import RewrittenPrograms, rewrite_for_retain
from .rowwise import RowwiseResult, prepare_for_rows, random_operators
from .validity import Validity, check_validity

__all__ = [
    "BackboneCall",
    "GradientNeed",
    "Linearity",
    "Programs",
    "RowwiseResult",
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
    "order_matrix_products",
    "prepare_for_rows",
    "prune_gradient_need",
    "random_operators",
    "rewrite_for_retain",
    "write_scatters_in_place",
]
