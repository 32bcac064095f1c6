"""An argument passed in one dtype in the rollout and in another in the update, with equal values, where the module
reads it only through a cast to one dtype: the update's call is the rollout's (FlowGRPO's FLUX scripts pass a bf16
``timestep`` and ``guidance`` in the rollout and float32 ones in the update; DanceGRPO's Wan script passes step 0's
latents in bf16, then in float32). Proven on the call's traced graph (leancompile.passes.casts), never assumed."""
import copy

import pytest
import torch

import leancompile
from leancompile import backbones
from leancompile.passes.casts import CastReads, cast_reads, same_after_casts
from leancompile.passes.meta import CASTS


def _flux(rows: int = 2):
    module = backbones.tiny("flux", seed=0, dtype=torch.bfloat16).model
    g = torch.Generator().manual_seed(1)
    side = torch.arange(4, dtype=torch.float32)
    img_ids = torch.stack([torch.zeros(16), side.repeat_interleave(4), side.repeat(4)], dim=-1)
    inputs = dict(hidden_states=torch.randn(rows, 16, 16, generator=g).bfloat16(),
                  encoder_hidden_states=torch.randn(rows, 8, 32, generator=g).bfloat16(),
                  pooled_projections=torch.randn(rows, 16, generator=g).bfloat16(),
                  img_ids=img_ids, txt_ids=torch.zeros(8, 3))
    return module, inputs


def _grads(module) -> torch.Tensor:
    return torch.cat([p.grad.flatten().float() for p in module.parameters() if p.requires_grad])


def _update(module, **inputs) -> torch.Tensor:
    module.zero_grad(set_to_none=True)
    module(**inputs, return_dict=False)[0].float().square().sum().backward()
    return _grads(module)


def _recomputed(wrapped):
    return [r for r in wrapped.last_calls if r.action == "recomputed"]


@pytest.mark.fast
def test_flux_float32_timestep_is_served_from_a_bf16_rollout():
    """The served call's gradients are bitwise those of the same update with the rollout's bf16 arguments (one kept
    call, one backward), and match the unwrapped module's on those arguments to bf16's noise only: the served
    backward is the one-row program mapped over the rows, which rounds otherwise than eager's batch (as in every
    bf16 comparison, test_retain_bf16). The unwrapped module itself computes bitwise the same on the float32 and
    on the bf16 arguments: it casts them."""
    module, inputs = _flux()
    native = copy.deepcopy(module)
    # 0.3 does not round-trip through bf16: the update's float32 0.3 cast to bf16 is the rollout's bf16 0.3
    timestep, guidance = torch.tensor([0.3, 0.75]), torch.tensor([3.5, 3.5])
    wrapped = leancompile.wrap(module)
    with torch.no_grad():
        wrapped(**inputs, timestep=timestep.bfloat16(), guidance=guidance.bfloat16(), return_dict=False)
    grads = _update(wrapped, **inputs, timestep=timestep, guidance=guidance)
    assert wrapped.stats()["served_calls"] == 1, wrapped.last_calls
    same_dtype = _update(wrapped, **inputs, timestep=timestep.bfloat16(), guidance=guidance.bfloat16())
    assert wrapped.stats()["served_calls"] == 1, wrapped.last_calls
    expected = _update(native, **inputs, timestep=timestep.bfloat16(), guidance=guidance.bfloat16())
    assert torch.equal(grads, same_dtype)
    assert torch.equal(expected, _update(native, **inputs, timestep=timestep, guidance=guidance))
    assert float(torch.nn.functional.cosine_similarity(grads, expected, dim=0)) > 0.9999
    torch.testing.assert_close(grads, expected, rtol=0.02, atol=0.02 * float(expected.abs().max()))


def test_flux_float32_timestep_is_served_per_block():
    """Per transformer block (FSDP2's way): the backbone call is verified with its arguments cast, the module's
    forward traced on fake weights; each block is then served the kept block call of those rows."""
    module, inputs = _flux()
    timestep, guidance = torch.tensor([0.3, 0.75]), torch.tensor([3.5, 3.5])
    wrapped = leancompile.wrap(module, per_block=True)
    with torch.no_grad():
        wrapped(**inputs, timestep=timestep.bfloat16(), guidance=guidance.bfloat16(), return_dict=False)
    grads = _update(wrapped, **inputs, timestep=timestep, guidance=guidance)
    stats = wrapped.stats()
    assert stats["served_calls"] == 4 and stats["recomputed_calls"] == 0, wrapped.last_calls
    assert torch.equal(grads, _update(wrapped, **inputs, timestep=timestep.bfloat16(), guidance=guidance.bfloat16()))


def test_flux_timestep_that_casts_to_another_bf16_value_recomputes():
    module, inputs = _flux()
    wrapped = leancompile.wrap(module)
    with torch.no_grad():
        wrapped(**inputs, timestep=torch.tensor([0.5, 0.75]).bfloat16(), guidance=torch.tensor([3.5, 3.5]).bfloat16(),
                return_dict=False)
    # 0.76 casts to bf16 0.7578125, not 0.75
    _update(wrapped, **inputs, timestep=torch.tensor([0.5, 0.76]), guidance=torch.tensor([3.5, 3.5]))
    [record] = _recomputed(wrapped)
    assert record.kind == "inputs", record
    for part in ("kwargs['timestep'] has dtype torch.float32, the kept call's torch.bfloat16",
                 "values cast so match no kept call's", "differs in kwargs['timestep']"):
        assert part in record.reason, record.reason


def _wan(rows: int = 2):
    module = backbones.tiny("wan", seed=0, dtype=torch.float32).model
    g = torch.Generator().manual_seed(1)
    inputs = dict(timestep=torch.tensor([500.0, 250.0][:rows]),
                  encoder_hidden_states=torch.randn(rows, 8, 32, generator=g))
    return module, torch.randn(rows, 4, 2, 8, 8, generator=g).bfloat16(), inputs


def test_wan_float32_latents_are_served_from_a_bf16_rollout_under_autocast():
    """Float32 weights under CPU bf16 autocast: the patch embedding's convolution reads the latents cast to bf16,
    and the rotary embedding reads their shape only."""
    module, latents, inputs = _wan()
    wrapped = leancompile.wrap(module)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            wrapped(hidden_states=latents, **inputs, return_dict=False)
        grads = _update(wrapped, hidden_states=latents.float(), **inputs)
    assert wrapped.stats()["served_calls"] == 1, wrapped.last_calls
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(grads, _update(wrapped, hidden_states=latents, **inputs))


class _ReadsItsValue(torch.nn.Module):
    """Reads ``t`` as float32: a float32 ``t`` is read as it is, not through a cast to bf16."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4, dtype=torch.bfloat16)

    def forward(self, x, t):
        return self.linear(x) * (t.float() * 2 + 1).to(x.dtype)[:, None]


@pytest.mark.fast
def test_an_argument_read_other_than_through_a_cast_recomputes_and_says_why():
    torch.manual_seed(0)
    wrapped = leancompile.wrap(_ReadsItsValue())
    x, t = torch.randn(2, 4).bfloat16(), torch.tensor([0.5, 0.25])
    with torch.no_grad():
        wrapped(x, t.bfloat16())
    wrapped.zero_grad()
    wrapped(x, t).float().sum().backward()
    [record] = _recomputed(wrapped)
    assert record.kind == "inputs", record
    assert ("argument kwargs['t'] has dtype torch.float32, the kept call's torch.bfloat16, and the module reads "
            "kwargs['t'] other than through a cast to torch.bfloat16: mul.Tensor reads it") in record.reason, record.reason


def _traced(fn, *args, mode="real"):
    from torch.fx.experimental.proxy_tensor import make_fx
    gm = make_fx(fn, tracing_mode=mode)(*args)
    return gm, list(gm.graph.find_nodes(op="placeholder"))


@pytest.mark.fast
def test_the_analysis_records_casts_and_other_reads_on_the_placeholder():
    x, t = torch.randn(3, dtype=torch.bfloat16), torch.randn(3)
    # traced with symbolic shapes: its size is read by a node of its own
    gm, (_, timestep) = _traced(lambda x, t: x * t.to(torch.bfloat16) * t.shape[0], x, t, mode="symbolic")
    assert any("sym_size" in str(user.target) for user in timestep.users)
    assert cast_reads(gm, timestep) == CastReads(torch.bfloat16) and timestep.meta[CASTS].cast_only
    gm, (_, timestep) = _traced(lambda x, t: x * t.to(torch.bfloat16) + t.sum(), x, t)
    assert timestep.meta.get(CASTS) is None
    assert cast_reads(gm, timestep) == CastReads(torch.bfloat16, "sum.default reads it") == timestep.meta[CASTS]
    gm, (_, timestep) = _traced(lambda x, t: x * t.to(torch.bfloat16) + t.to(torch.float16), x, t)
    assert cast_reads(gm, timestep).other == "it is cast to torch.bfloat16 and to torch.float16"
    gm, (_, timestep) = _traced(lambda x, t: (x, t), x, t)
    assert cast_reads(gm, timestep).other == "it is returned by the graph"


def test_a_module_that_reads_the_dtype_elsewhere_computes_otherwise():
    """Reads ``t`` only through a cast, but branches on its dtype: the graph traced on ``t`` cast is another."""
    x, t = torch.randn(3, dtype=torch.bfloat16), torch.randn(3)
    plain = lambda x, t: x * t.to(torch.bfloat16)  # noqa: E731
    branching = lambda x, t: x * t.to(torch.bfloat16) * (2 if t.dtype == torch.float32 else 1)  # noqa: E731
    for fn, same in ((plain, True), (branching, False)):
        cast, _ = _traced(fn, x, t)
        kept, _ = _traced(fn, x, t.bfloat16())
        assert same_after_casts(cast, kept, [1]) is same
