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
from .moments import BufferPlan, advantage_bound, clip_never_binds, max_abs_advantage, reweight_buffers
from .rewrite import RewrittenPrograms, rewrite_for_retain
from .validity import Validity, check_validity

__all__ = [
    "BackboneCall",
    "BufferPlan",
    "GradientNeed",
    "Linearity",
    "Programs",
    "RewrittenPrograms",
    "SharedBackbone",
    "Validity",
    "advantage_bound",
    "capture",
    "capture_provisional",
    "check_linearity",
    "check_validity",
    "clip_never_binds",
    "detect_shared_backbone",
    "drop_copies_of_unshared_values",
    "drop_multiplications_by_one",
    "max_abs_advantage",
    "order_matrix_products",
    "prune_gradient_need",
    "reweight_buffers",
    "rewrite_for_retain",
    "write_scatters_in_place",
]
