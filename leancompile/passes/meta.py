"""The ``node.meta`` keys the passes write. Each analysis owns one key."""

INPUT = "leancompile.input"  # placeholder role: "param:<name>" | "buffer:<name>" | "data:<name>"
CALL = "leancompile.call"  # BackboneCall: the module call that created the node
SHARED = "leancompile.shared"  # update node -> the name of its structurally identical rollout node
PROVENANCE = "leancompile.provenance"  # backbone-call input -> RowSource segments it was gathered from
NEEDS_GRAD = "leancompile.needs_grad"  # backbone output -> tuple of the row segments the loss differentiates
FINDING = "leancompile.finding"  # validity findings attached to the node they concern
REWRITE = "leancompile.rewrite"  # "inserted" | "reused" | "in-place" | "reordered" on nodes a pass made
MATMUL_ORDER = "leancompile.matmul_order"  # mm / bmm -> ProductTiming: seconds as written and with operands swapped
LINEARITY = "leancompile.linearity"  # "affine" | "tie" on update nodes that depend on the advantages
PROVISIONAL = "leancompile.provisional"  # Reweight's rollout: "loss" (head at A = 1), "backward", or the weight's name
