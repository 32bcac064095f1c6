"""The ``node.meta`` keys the passes write, and the values they take where those are a fixed set. Each analysis
owns one key."""
import enum

INPUT = "leancompile.input"  # placeholder role: "param:<name>" | "buffer:<name>" | "data:<name>"
CALL = "leancompile.call"  # BackboneCall: the module call that created the node
SHARED = "leancompile.shared"  # update node -> the name of its structurally identical rollout node
PROVENANCE = "leancompile.provenance"  # backbone-call input -> RowSource segments it was gathered from
NEEDS_GRAD = "leancompile.needs_grad"  # backbone output -> tuple of the row segments the loss differentiates
FINDING = "leancompile.finding"  # validity findings attached to the node they concern
REWRITE = "leancompile.rewrite"  # Rewrite: what a pass did to the node
ROWS = "leancompile.rows"  # the rows a Rewrite.FOLDED or Rewrite.SUMMED node stands for
MATMUL_ORDER = "leancompile.matmul_order"  # mm / bmm -> ProductTiming: seconds as written and with operands swapped
LINEARITY = "leancompile.linearity"  # Linear, on update nodes that depend on the advantages
PROVISIONAL = "leancompile.provisional"  # Provisional: the part of Reweight's rollout the node belongs to
PARAMETER = "leancompile.parameter"  # a provisional gradient output -> the name of its weight
FACTORS = "leancompile.factors"  # a per-row backward's output node -> how many leading outputs are weights' gradients
# that may be returned as their factors (set before the passes); after keep_products_as_factors, FACTORED -> the
# positions of those it returns so
FACTORED = "leancompile.factored"
CASTS = "leancompile.casts"  # a data placeholder -> CastReads: read only through casts to one dtype, or why not


class Rewrite(str, enum.Enum):
    INSERTED = "inserted"  # made by the Retain rewrite or Reweight's provisional capture
    REUSED = "reused"  # the placeholder that reads the rollout's kept backbone output
    IN_PLACE = "in-place"  # a scatter and the buffer it now writes into
    REORDERED = "reordered"  # a matrix product computed as (B^T A^T)^T
    RESHAPE = "reshape"  # a view made a reshape (vmap's row dimension)
    CLAMPED = "clamped"  # a slice's open end closed to the dimension's size
    FOLDED = "folded per-row calls"  # ROWS per-row calls of one operator as one call
    SUMMED = "sum over rows of products as one product"  # a weight gradient over ROWS rows as one mm
    FUSED = "bias fused into its product"  # vmap's mm + bias made eager's addmm again
    FACTOR = "a factor of a per-row product returned in its place"  # keep_products_as_factors

    def __str__(self) -> str:
        return self.value


class Linear(str, enum.Enum):
    AFFINE = "affine"  # affine in the advantages
    TIE = "tie"  # a max/min proven to tie at ratio 1

    def __str__(self) -> str:
        return self.value


class Provisional(str, enum.Enum):
    LOSS = "loss"  # the loss head at advantage 1
    BACKWARD = "backward"  # its backward into the trainable weights
    GRADIENT = "gradient"  # an output: one weight's provisional gradient (PARAMETER names it)

    def __str__(self) -> str:
        return self.value
