"""Every answer is the current module's: writes that move no version counter (through ``.data``, ``set_``), swaps of
a reference's or an EMA's weights in and out, optimizer steps and ``load_state_dict`` between a kept call and a later
one are seen by the digest of the weights' values (:mod:`leancompile.runtime.digest`), each answer compared. A call
made while other weights are in place recomputes and says why; calls after they are swapped back are served."""
import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import leancompile
from leancompile import backbones
from leancompile.runtime.digest import digest


# ----------------------------------------------------------------------------------------------- the digest

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.bool]


@settings(max_examples=60)
@given(dtype=st.sampled_from(DTYPES), shapes=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=1,
                                                       max_size=4),
       seed=st.integers(0, 2**16), change=st.sampled_from(["word", "sign", "permute", "swap two", "scale"]),
       weighted=st.booleans())
def test_the_digest_sees_every_change_of_a_value(dtype, shapes, seed, change, weighted):
    """The CPU's XXH3 and CUDA's int8 products (``weighted``, run on the CPU here) alike."""
    generator = torch.Generator().manual_seed(seed)
    tensors = [(torch.randn(s, generator=generator) * 3).to(dtype) for s in shapes]
    before = digest(tensors, weighted)
    assert torch.equal(before, digest([t.clone() for t in tensors], weighted)), "the digest depends on the values only"
    target = tensors[seed % len(tensors)]
    flat = target.view(-1)
    old = flat.clone()
    if change == "word":
        words = flat.view(torch.uint8)
        words[seed % words.numel()] ^= 1 << (seed % 8) or 1
    elif change == "sign":
        flat.copy_(flat.logical_not() if dtype == torch.bool else -flat)
    elif change == "permute":
        flat.copy_(flat[torch.randperm(flat.numel(), generator=generator)])
    elif change == "swap two" and flat.numel() > 1:
        flat[[0, -1]] = flat[[-1, 0]]
    elif change == "scale" and dtype != torch.bool:
        flat.mul_(2)
    after = digest(tensors, weighted)
    if torch.equal(flat.view(torch.uint8), old.view(torch.uint8)):
        assert torch.equal(after, before)  # the change left every byte as it was (a permutation of equal values)
    else:
        position = [t is target for t in tensors].index(True)
        assert after[position] != before[position]
        assert torch.equal(torch.cat([after[:position], after[position + 1:]]),
                           torch.cat([before[:position], before[position + 1:]]))


def test_the_weighted_digest_reads_whole_rows_in_place_and_its_fallback_gives_the_same_integers(monkeypatch):
    """CUDA's digest on the CPU: a tensor of whole rows from ``IN_PLACE`` bytes is multiplied where it lies, others
    are copied into buckets (one of fewer than 17 rows padded for CUDA's int8 product); a device without int8
    products computes the same integers in float32. Every single changed byte is seen, in place or copied."""
    from leancompile.runtime import digest as module

    generator = torch.Generator().manual_seed(0)
    big = torch.randn(256, 160, generator=generator)  # 160 KiB: whole rows of ROW bytes
    tensors = [big, torch.randn(100, 333, generator=generator), torch.randn(3, generator=generator),
               torch.randn(5, 2, generator=generator).t()]
    rows = next(module._rows([module._bytes(big)], (0,), big.device))
    assert rows.data_ptr() == big.data_ptr() and rows.shape == (big.nbytes // module.ROW, module.ROW)
    shifted = torch.randn(1 + big.numel(), generator=generator)[1:]  # whole rows off a 16-byte boundary: copied
    assert next(module._rows([module._bytes(shifted)], (0,), big.device)).data_ptr() % 16 == 0
    assert torch.equal(digest([shifted], weighted=True), digest([shifted.clone()], weighted=True))
    products = digest(tensors, weighted=True)
    monkeypatch.setattr(module, "_int8_products", lambda device: False)
    assert torch.equal(digest(tensors, weighted=True), products)
    monkeypatch.undo()
    for i, t in enumerate(tensors):
        for position in (0, t.nbytes // 2, t.nbytes - 1):
            changed = [u.clone() for u in tensors]
            flat = changed[i].contiguous() if not changed[i].is_contiguous() else changed[i]
            flat.view(-1).view(torch.uint8)[position] ^= 0x80
            changed[i] = flat
            after = digest(changed, weighted=True)
            assert after[i] != products[i] and torch.equal(after[:i], products[:i])
            assert torch.equal(after[i + 1:], products[i + 1:])


def test_the_digest_refuses_a_tensor_whose_storage_was_freed():
    from leancompile.runtime.digest import Unreadable

    t = torch.randn(4, 4)
    t.untyped_storage().resize_(0)  # as FSDP frees an unsharded parameter when it reshards
    with pytest.raises(Unreadable):
        digest([t])


def test_a_digested_tensor_can_still_be_freed():
    """FSDP frees a gathered parameter by resizing its storage to 0 after the digest has read it: reading it must
    not pin the storage (as a NumPy view of it would), and a strided view digests as its values."""
    t = torch.randn(6, 5)
    column = t[:, 1]
    assert torch.equal(digest([column]), digest([column.clone()]))
    digest([t])
    t.untyped_storage().resize_(0)


# ------------------------------------------------------------------------------------- writes in a loop

def _data_copy(p, values):
    p.data.copy_(values)


def _data_assign(p, values):
    p.data = values.clone()


def _set(p, values):
    with torch.no_grad():
        p.set_(values.clone())


def _copy_no_grad(p, values):
    with torch.no_grad():
        p.copy_(values)


WRITES = {"data.copy_": _data_copy, "data = t": _data_assign, "set_ under no_grad": _set,
          "copy_ under no_grad": _copy_no_grad}


def _model(family="sd3", seed=0):
    base = backbones.tiny(family, seed=seed, dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)
    rows = 4
    x = torch.randn((rows, *base.latent_shape), generator=generator, dtype=torch.float64)
    sigma = torch.full((rows,), 0.7, dtype=torch.float64)
    cond = base.dummy_conditioning(rows, generator, dtype=torch.float64)
    return base, (x, sigma, cond)


@pytest.mark.fast
@pytest.mark.parametrize("write", WRITES)
def test_a_call_after_a_write_that_moves_no_version_recomputes_and_names_it(write):
    base, inputs = _model()
    native = copy.deepcopy(base)
    leancompile.wrap(base.model)
    other = {n: p.detach() * 1.01 for n, p in base.model.named_parameters()}
    for b in (base, native):
        with torch.no_grad():
            b(*inputs)
        name = "transformer_blocks.0.attn.to_q.weight"
        WRITES[write](dict(b.model.named_parameters())[name], other[name])
        b(*inputs).square().sum().backward()
    calls = base.model.last_calls
    stats = base.model.stats()
    assert stats["served_calls"] == 0 and stats["recomputed_calls"] == 1, stats
    reason = calls[-1].reason
    if "no_grad" in write:  # moves the version counter: the weights' versions differ
        assert calls[-1].kind == "weights" and "written since the kept call" in reason
    else:
        assert calls[-1].kind == "written" and "transformer_blocks.0.attn.to_q.weight" in reason, reason
    for p, q in zip(base.model.parameters(), native.model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=0)


def _swap(model, values: list) -> list:
    """Swap ``values`` into the model's parameters through ``.data`` (as Flow-Factory swaps its reference and EMA
    weights, and diffusers' ``EMAModel.copy_to``); returns what was there."""
    saved = [p.data.clone() for p in model.parameters()]
    for p, v in zip(model.parameters(), values):
        p.data.copy_(v)
    return saved


def _flow_factory_like(family: str, wrapped: bool, options: dict | None = None, epochs: int = 2):
    """Full fine-tuning with a KL reference swapped into the policy through ``.data`` inside the update phase, an
    evaluation with EMA weights swapped in before each rollout, and two optimizer steps per rollout. Returns each
    optimizer step's gradient, each KL value and the wrapped module's statistics."""
    base, (x, sigma, cond) = _model(family)
    model = base.model
    torch.manual_seed(1)
    reference = [p.detach() + 1e-3 * torch.randn_like(p) for p in model.parameters()]
    ema = [p.detach().clone() for p in model.parameters()]
    if wrapped:
        leancompile.wrap(model, **(options or {}))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    steps = [x * (1 - s) + s for s in (0.0, 0.25, 0.5, 0.75)]
    applied, kls, stats = [], [], []
    for _ in range(epochs):
        saved = _swap(model, ema)  # evaluate with the EMA's weights
        model.eval()
        with torch.no_grad():
            base(x, sigma, cond)
        _swap(model, saved)
        with torch.no_grad():  # the rollout
            outputs = [base(latent, sigma, cond) for latent in steps]
        model.train()
        for half in (steps[:2], steps[2:]):
            for latent in half:
                velocity = base(latent, sigma, cond)
                saved = _swap(model, reference)
                with torch.no_grad():
                    velocity_reference = base(latent, sigma, cond)
                _swap(model, saved)
                kl = (velocity - velocity_reference).square().mean()
                kls.append(kl.item())
                (velocity.mean() * 0.3 + kl).backward()
            applied.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():
            for e, p in zip(ema, model.parameters()):
                e.mul_(0.9).add_(p, alpha=0.1)
        if wrapped:
            stats.append(model.stats())
    return applied, kls, stats, outputs


@pytest.mark.parametrize("family, options", [
    pytest.param("sd3", {}, marks=pytest.mark.fast), ("flux", {"per_block": True}), ("sd3", {"bitwise": True}),
    ("sd3", {"schedule": "auto"}), ("sd3", {"trained": lambda n: n % 5 != 0})])
def test_reference_and_ema_swaps_through_data_are_never_answered_from_the_policy(family, options):
    """Every placement of the line: the whole call, per block, bitwise Retain, auto, a ``trained=`` hint that
    leaves the EMA's evaluation call unkept."""
    per_block = options.get("per_block", False)
    native_grads, native_kls, _, _ = _flow_factory_like(family, wrapped=False)
    grads, kls, stats, _ = _flow_factory_like(family, wrapped=True, options=options)
    assert all(k > 0 for k in native_kls)
    assert kls == pytest.approx(native_kls, rel=1e-10, abs=0)
    for g, n in zip(grads, native_grads):
        assert float((g - n).norm() / n.norm()) <= 1e-10
    for epoch in stats:
        # the first optimizer step's update calls are served (the EMA's evaluation kept nothing that serves them)
        expected = 2 * (len(_block_stacks(family)) if per_block else 1)
        assert epoch["served_calls"] >= expected, epoch
        assert set(epoch["recompute_reasons"]) == {"weights"}, epoch  # the calls after the first optimizer step


def _block_stacks(family):
    from leancompile.runtime.regional import transformer_blocks

    return transformer_blocks(backbones.tiny(family, seed=0).model)


def test_diffusers_ema_model_swaps_are_seen():
    from diffusers.training_utils import EMAModel

    base, inputs = _model()
    native = copy.deepcopy(base)
    leancompile.wrap(base.model)
    for b in (base, native):
        ema = EMAModel(b.model.parameters(), decay=0.5)
        with torch.no_grad():
            b(*inputs)
            for p in b.model.parameters():
                p.mul_(1.01)  # the policy moved on (an optimizer step)
        ema.step(b.model.parameters())
        with torch.no_grad():
            b(*inputs)  # kept with the policy's weights
        ema.store(b.model.parameters())
        ema.copy_to(b.model.parameters())  # evaluate with the EMA's weights
        with torch.no_grad():
            evaluated = b(*inputs)
        ema.restore(b.model.parameters())
        b(*inputs).square().sum().backward()
        b.evaluated = evaluated
    torch.testing.assert_close(base.evaluated, native.evaluated, rtol=0, atol=0)
    for p, q in zip(base.model.parameters(), native.model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=0)
    assert base.model.stats()["served_calls"] == 1


def test_load_state_dict_and_a_fused_optimizer_step_recompute():
    base, inputs = _model()
    native = copy.deepcopy(base)
    leancompile.wrap(base.model)
    state = {k: v * 1.01 for k, v in base.model.state_dict().items()}
    for b in (base, native):
        with torch.no_grad():
            b(*inputs)
        b.model.load_state_dict(state)
        b(*inputs).sum().backward()
        optimizer = torch.optim.Adam(b.model.parameters(), lr=1e-3, fused=True)
        with torch.no_grad():
            b(*inputs)
        optimizer.step()
        b.model.zero_grad()
        b(*inputs).sum().backward()
    stats = base.model.stats()
    assert stats["served_calls"] == 0 and stats["recomputed_calls"] == 2, stats
    for p, q in zip(base.model.parameters(), native.model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=0)


# ------------------------------------------------------------------------------------------- true reasons

class TwoArguments(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 6, dtype=torch.float64)

    def forward(self, x, timestep):
        return self.linear(x) * timestep.to(torch.float64)[:, None]


def test_an_inputs_reason_names_the_argument_and_how_it_differs():
    module = leancompile.wrap(TwoArguments())
    x, t = torch.randn(3, 6, dtype=torch.float64), torch.full((3,), 0.5)
    with torch.no_grad():
        module(x, timestep=t.to(torch.bfloat16))
    module(x, timestep=t).sum().backward()  # another dtype
    module(x + 1, timestep=t.to(torch.bfloat16)).sum().backward()  # another value
    first, second = [r for r in module.last_calls if r.action == "recomputed"]
    assert "kwargs['timestep'] has dtype torch.float32, the kept call's torch.bfloat16" in first.reason, first
    assert second.reason.endswith("the nearest kept row differs in kwargs['x']"), second


def test_reweight_calls_after_a_second_optimizer_step_say_weights_and_are_not_warned(recwarn):
    module = leancompile.wrap(TwoArguments(), schedule="reweight")
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    batches = [(torch.randn(2, 6, dtype=torch.float64), torch.full((2,), 0.5, dtype=torch.float64)) for _ in range(4)]
    with torch.no_grad():
        for x, t in batches:
            module(x, t)
    module.provisional(lambda a: a * sum(module(x, t).sum() for x, t in batches))
    for half in (batches[:2], batches[2:]):
        for x, t in half:
            module(x, t).sum().backward()
            with torch.no_grad():
                module(x, 2 * t)  # a call without grad after the step (a KL reference's): not a new rollout's rows
        optimizer.step()
    recomputed = [r for r in module.last_calls if r.action == "recomputed"]
    assert [r.kind for r in recomputed] == ["weights", "weights"], recomputed
    assert all("freed" in r.reason and "written since the kept call" in r.reason for r in recomputed)
    assert not [w for w in recwarn if issubclass(w.category, leancompile.NothingServedWarning)]



def test_verify_versions_trusts_the_loop_and_a_bad_value_is_refused_by_name():
    """``verify="versions"`` reads no weight's values: a write through ``.data`` is not seen (the loop is trusted
    not to make one), and nothing is digested."""
    module = leancompile.wrap(TwoArguments(), verify="versions")
    x, t = torch.randn(3, 6, dtype=torch.float64), torch.full((3,), 0.5, dtype=torch.float64)
    with torch.no_grad():
        module(x, t)
    module.linear.weight.data.mul_(2)
    module(x, t).sum().backward()
    assert module.stats()["served_calls"] == 1
    assert module.engine.reader.digested == []
    with pytest.raises(ValueError, match="verify must be one of"):
        leancompile.wrap(TwoArguments(), verify="bytes")


def test_a_reference_swapped_in_through_data_inside_reweights_head_runs_on_the_reference():
    """Flow-Factory computes its KL reference by copying the reference's weights into the policy module through
    ``.data``. Inside Reweight's provisional head that call runs on the reference's weights (it is not answered with
    the policy's kept output, which would leave the head's KL cotangent at zero): the update's call is then in the
    span and served, with native's gradient."""
    torch.manual_seed(0)
    base = TwoArguments()
    native, module = copy.deepcopy(base), leancompile.wrap(base, schedule="reweight")
    reference = module.linear.weight.detach() * 0.9
    x, t = torch.randn(3, 6, dtype=torch.float64), torch.full((3,), 0.5, dtype=torch.float64)

    def loss(m, advantage):
        policy = m.linear.weight.data.clone()
        m.linear.weight.data.copy_(reference)  # no version counter moves
        with torch.no_grad():
            kl_reference = m(x, t)  # before the policy's call: the kept rows are still free to answer it
        m.linear.weight.data.copy_(policy)
        out = m(x, t)
        return (advantage * out).sum() + 0.05 * (out - kl_reference).square().sum()

    with torch.no_grad():
        module(x, t)
    module.provisional(lambda a: loss(module, a))
    loss(module, 0.7).backward()
    loss(native, 0.7).backward()
    served = [r for r in module.last_calls if r.action == "served"]
    assert len(served) == 1 and module.stats()["recompute_reasons"].get("cotangent") is None, module.last_calls
    for p, q in zip(module.parameters(), native.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=0)
