"""``leancompile.wrap`` on modules as frameworks hold and call them: the wrapped module stays the module, a call is
its bound call, a forward assigned on it still runs through the engine, an output that is not one row-laid tensor
is served through the submodule that computes its rows, and a loop that gains nothing is told so."""
import copy
import functools
import itertools
import types
import warnings

import pytest
import torch

import leancompile
from leancompile import backbones
from leancompile.runtime import auto
from leancompile.wrapping.wrapped import RUNTIME

FLOOR = auto.AUTO_FLOOR  # read before conftest's fixture sets it to 0 for the suite


def _sd3():
    backbone = backbones.tiny("sd3", seed=0, dtype=torch.float64)
    text = backbone.dummy_conditioning(3, torch.Generator().manual_seed(1), dtype=torch.float64)
    latents = torch.randn(3, *backbone.latent_shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    inputs = dict(hidden_states=latents, timestep=torch.tensor([500.0, 300.0, 100.0], dtype=torch.float64),
                  encoder_hidden_states=text.text, pooled_projections=text.pooled)
    return backbone.model, inputs


def _grads(module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in module.parameters() if p.requires_grad])


def _update(module, **inputs) -> torch.Tensor:
    module.zero_grad(set_to_none=True)
    module(**inputs, return_dict=False)[0].square().sum().backward()
    return _grads(module)


def test_none_passed_and_left_out_to_its_default_are_one_call():
    """FlowGRPO's rollout passes ``joint_attention_kwargs=None``, its update leaves the argument out."""
    module, inputs = _sd3()
    native = _update(module, **inputs)
    wrapped = leancompile.wrap(module)
    with torch.no_grad():
        wrapped(**inputs, joint_attention_kwargs=None, return_dict=False)
    grads = _update(wrapped, **inputs)
    assert wrapped.stats()["served_calls"] == 1
    torch.testing.assert_close(grads, native, rtol=1e-10, atol=1e-12)


def test_positional_and_keyword_spellings_are_one_call():
    module, inputs = _sd3()
    wrapped = leancompile.wrap(module)
    with torch.no_grad():
        wrapped(inputs["hidden_states"], inputs["encoder_hidden_states"], inputs["pooled_projections"],
                inputs["timestep"], return_dict=False)
    _update(wrapped, **inputs)
    assert wrapped.stats()["served_calls"] == 1


def test_a_recompute_names_the_argument_that_differs():
    module, inputs = _sd3()
    wrapped = leancompile.wrap(module)
    with torch.no_grad():
        wrapped(**inputs, return_dict=False)
    wrapped.zero_grad()
    wrapped(**inputs, return_dict=False, skip_layers=[0])[0].sum().backward()
    [record] = [r for r in wrapped.last_calls if r.action == "recomputed"]
    assert record.kind == "inputs" and "skip_layers" in record.reason, record


def test_the_module_keeps_its_class_its_keys_and_what_saves_it(tmp_path):
    module, _ = _sd3()
    keys, cls = list(module.state_dict()), type(module)
    wrapped = leancompile.wrap(module)
    assert wrapped is module and isinstance(wrapped, cls) and isinstance(wrapped, leancompile.Wrapped)
    assert list(wrapped.state_dict()) == keys
    wrapped.save_pretrained(tmp_path)
    reloaded = cls.from_pretrained(tmp_path, torch_dtype=torch.float64)
    assert type(reloaded) is cls
    for (name, a), (_, b) in zip(wrapped.state_dict().items(), reloaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert type(leancompile.unwrap(wrapped)) is cls


def test_a_forward_assigned_on_the_wrapped_module_runs_through_the_engine():
    """TRL assigns its fused log-prob head as ``model.forward``, accelerate its autocast wrapper: the assigned
    forward is what the module computes, and its calls are still kept and served."""
    module, inputs = _sd3()
    original = module.forward
    wrapped = leancompile.wrap(module)
    wrapped.forward = types.MethodType(lambda self, **kw: (original(**kw)[0] * 2.0,), wrapped)
    with torch.no_grad():
        kept = wrapped(**inputs, return_dict=False)[0]
    grads = _update(wrapped, **inputs)
    assert wrapped.stats()["served_calls"] == 1
    leancompile.unwrap(wrapped)
    del module.forward
    torch.testing.assert_close(kept, 2.0 * module(**inputs, return_dict=False)[0], rtol=1e-12, atol=1e-12)
    module.zero_grad()
    (2.0 * module(**inputs, return_dict=False)[0]).square().sum().backward()
    torch.testing.assert_close(grads, _grads(module), rtol=1e-10, atol=1e-12)


class ScoredModel(torch.nn.Module):
    """A model output as TRL's fused head returns one: a scalar loss over every row, per-row log-probs and entropy,
    and a bool mask; the rows come from its ``body``."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32)).double()
        self.head = torch.nn.Linear(32, 5).double()
        for p in self.parameters():
            torch.nn.init.normal_(p, std=0.3, generator=generator)

    def forward(self, x, labels):
        logits = self.head(self.body(x)).log_softmax(-1)
        log_probs = logits.gather(-1, labels[:, None])[:, 0]
        entropy = -(logits.exp() * logits).sum(-1)
        return {"loss": -log_probs.mean(), "log_probs": log_probs, "entropy": entropy, "mask": labels > 0}


def test_an_output_that_is_not_row_laid_is_served_through_the_submodule_that_computes_its_rows():
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    labels = torch.tensor([0, 3, 1, 4])
    native = ScoredModel()
    native(x, labels)["loss"].backward()
    wrapped = leancompile.wrap(ScoredModel())
    with torch.no_grad():
        wrapped(x, labels)
    wrapped(x, labels)["loss"].backward()
    stats = wrapped.stats()
    assert stats["served_calls"] == 1 and stats["served_by"] == "body", stats
    for a, b in zip(wrapped.parameters(), native.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-14)


def test_an_optimizer_step_after_calls_none_of_which_was_served_warns_once_with_the_reason_and_fix():
    module, inputs = _sd3()
    wrapped = leancompile.wrap(module)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=1e-3)
    with torch.no_grad():
        wrapped(**inputs, return_dict=False)
    shifted = dict(inputs, hidden_states=inputs["hidden_states"] + 1)
    with pytest.warns(leancompile.NothingServedWarning, match="inputs: row 0: no kept call has these inputs.*Fix"):
        _update(wrapped, **shifted)
        optimizer.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error", leancompile.NothingServedWarning)  # once per cause
        _update(wrapped, **shifted)
        optimizer.step()


def test_strict_turns_the_warning_into_an_error():
    module, inputs = _sd3()
    wrapped = leancompile.wrap(module, strict=True)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=1e-3)
    _update(wrapped, **inputs)
    with pytest.raises(leancompile.NothingServedError, match="nothing kept"):
        optimizer.step()


def test_a_served_loop_is_not_warned_and_its_second_optimizer_step_is_expected():
    module, inputs = _sd3()
    wrapped = leancompile.wrap(module)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", leancompile.NothingServedWarning)
        with torch.no_grad():
            wrapped(**inputs, return_dict=False)
        _update(wrapped, **inputs)
        optimizer.step()
        _update(wrapped, **inputs)  # the same rollout after an optimizer step: recomputes, as it must
        optimizer.step()
    assert wrapped.stats()["recompute_reasons"] == {"weights": 1}


def test_after_an_optimizer_step_reweight_gives_weights_as_the_reason():
    module, inputs = _sd3()
    wrapped = leancompile.wrap(module, schedule="reweight")
    with torch.no_grad():
        wrapped(**inputs, return_dict=False)
    wrapped.provisional(lambda a: a * wrapped(**inputs, return_dict=False)[0].square().sum())
    _update(wrapped, **inputs)
    torch.optim.SGD(wrapped.parameters(), lr=1e-3).step()
    _update(wrapped, **inputs)
    assert [r.kind for r in wrapped.last_calls if r.action == "recomputed"] == ["weights"]


def test_torchs_batching_rule_warnings_do_not_reach_the_user():
    module, inputs = _sd3()
    wrapped = leancompile.wrap(module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            wrapped(**inputs, return_dict=False)
        _update(wrapped, **inputs)
    assert not [w for w in caught if "performance drop" in str(w.message)]


def _clock(native: float, program: float):
    """auto's clock, read where each cycle begins: the first (compiling) cycle takes 10 s, then the cycles
    alternate native's ``native`` seconds and the program's ``program``."""
    times = itertools.accumulate(itertools.chain([0.0, 10.0], itertools.cycle([native, program])))
    return lambda: next(times)


def _cycle(wrapped, native, optimizers, inputs, notes: list | None = None) -> dict:
    """One cycle of a loop (a rollout call, an update, an optimizer step), natively on ``native`` alongside: the
    gradients are native's; returns the wrapped module's stats, and adds auto's notes to ``notes``."""
    with torch.no_grad():
        wrapped(**inputs, return_dict=False)
    torch.testing.assert_close(_update(wrapped, **inputs), _update(native, **inputs), rtol=1e-10, atol=1e-12)
    for optimizer in optimizers:
        optimizer.step()
    if notes is not None:
        notes += [r.reason for r in wrapped.last_calls if r.kind == "auto"]  # before stats() clears them
    return wrapped.stats()


def _trial(monkeypatch, native_seconds: float, program_seconds: float):
    monkeypatch.setattr(auto, "AUTO_FLOOR", FLOOR)  # the suite's own is 0 (conftest): no trial
    monkeypatch.setattr(auto, "now", _clock(native_seconds, program_seconds))
    module, inputs = _sd3()
    native = copy.deepcopy(module)
    wrapped = leancompile.wrap(module, schedule="auto")
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (wrapped, native)]
    cycle = functools.partial(_cycle, wrapped, native, optimizers, inputs)
    return wrapped, lambda *notes: cycle(*notes)["served_calls"]


def test_auto_tries_whole_cycles_natively_and_with_the_program_and_runs_natively_where_slower(monkeypatch):
    """After the first (compiling) cycle, three pairs of cycles alternate native (nothing kept, nothing said) and
    the program; measured slower, the loop runs natively from the next rollout on, and says so once."""
    wrapped, cycle = _trial(monkeypatch, native_seconds=1.0, program_seconds=2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", leancompile.NothingServedWarning)
        assert [cycle() for _ in range(7)] == [1, 0, 1, 0, 1, 0, 1]
    notes = []
    with pytest.warns(leancompile.NothingServedWarning, match=r"took 1 s and 2 s a cycle \(medians\): 0.50x, below "):
        served = cycle(notes)
    assert served == 0 and len(notes) == 1 and "runs natively from now on" in notes[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", leancompile.NothingServedWarning)  # said once
        assert cycle() == 0
    assert "runs natively from now on" in wrapped.stats()["stopped"]


def test_auto_keeps_the_program_where_it_is_faster_and_says_when_its_compile_is_repaid(monkeypatch):
    wrapped, cycle = _trial(monkeypatch, native_seconds=2.0, program_seconds=1.0)
    assert [cycle() for _ in range(7)] == [1, 0, 1, 0, 1, 0, 1]
    assert wrapped.stats()["trying"]
    notes = []
    assert cycle(notes) == 1
    assert len(notes) == 1 and "2.00x" in notes[0] and "is repaid after" in notes[0], notes
    assert [cycle() for _ in range(2)] == [1, 1]
    stats = wrapped.stats()
    assert stats["stopped"] is None and not stats["trying"]


def test_auto_counts_a_cycle_from_rollout_to_rollout_through_several_steps_and_references(monkeypatch):
    """FlowGRPO's update takes two optimizer steps per rollout and computes a KL reference without grad after each
    micro-step's call with grad: the rollouts alone begin cycles (a call without grad right after a step)."""
    monkeypatch.setattr(auto, "AUTO_FLOOR", FLOOR)
    monkeypatch.setattr(auto, "now", _clock(1.0, 2.0))
    module, inputs = _sd3()
    wrapped = leancompile.wrap(module, schedule="auto")
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=1e-3)
    served = []
    for _ in range(8):
        with torch.no_grad():
            wrapped(**inputs, return_dict=False)
        for _ in range(2):
            _update(wrapped, **inputs)
            with torch.no_grad():  # the reference
                wrapped(**{**inputs, "timestep": inputs["timestep"] + 1}, return_dict=False)
            optimizer.step()
        stats = wrapped.stats()
        served.append(stats["served_calls"])
    assert served == [1, 0, 1, 0, 1, 0, 1, 0], served
    assert "0.50x" in stats["stopped"]


class _Scored(torch.nn.Module):
    """A head that reduces its transformer's output over the rows (as TRL's fused loss does): its own calls cannot
    be kept by row, and its transformer serves them."""

    def __init__(self, transformer: torch.nn.Module):
        super().__init__()
        self.transformer = transformer

    def forward(self, return_dict: bool = False, **inputs):
        return (self.transformer(**inputs, return_dict=return_dict)[0].mean(),)


def test_auto_stops_the_submodule_that_serves_once_calls_descended(monkeypatch):
    monkeypatch.setattr(auto, "AUTO_FLOOR", FLOOR)
    monkeypatch.setattr(auto, "now", _clock(1.0, 2.0))
    module, inputs = _sd3()
    native = _Scored(copy.deepcopy(module))
    wrapped = leancompile.wrap(_Scored(module), schedule="auto")
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (wrapped, native)]
    served = []
    for _ in range(8):
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            served.append(_cycle(wrapped, native, optimizers, inputs)["served_calls"])
    assert served == [1, 0, 1, 0, 1, 0, 1, 0], served
    assert [str(w.message) for w in said if "auto:" in str(w.message)]
    assert wrapped.stats()["served_by"] == "transformer"
    assert "runs natively from now on" in module.__dict__[RUNTIME].policy.stopped


def test_a_compile_that_recurs_at_every_cycle_is_inside_the_programs_cycles(monkeypatch):
    """TRL calls transformers' ``enable_input_require_grads`` at every step, which adds one more hook to the
    embeddings each time: the module's state differs at each step, and each program cycle compiles again. The
    trial's program cycles hold those compiles (timed for real here: seconds against native's milliseconds)."""
    monkeypatch.setattr(auto, "AUTO_FLOOR", FLOOR)
    module, inputs = _sd3()
    native = copy.deepcopy(module)
    wrapped = leancompile.wrap(module, schedule="auto")
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (wrapped, native)]
    compiled = []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(8):
            module.pos_embed.register_forward_hook(lambda m, args, out: None)  # one more each step
            compiled.append(_cycle(wrapped, native, optimizers, inputs)["compile_seconds"] > 0)
    assert compiled == [True, False, True, False, True, False, True, False], compiled
    assert len([w for w in said if "auto:" in str(w.message) and "below" in str(w.message)]) == 1


def test_compile_time_is_counted_apart_from_the_calls_it_compiled_for():
    """The first kept and served calls compile and trace their programs: the seconds go to
    ``stats()["compile_seconds"]``, and the calls' records (auto's program times) hold their runs alone."""
    module, inputs = _sd3()
    wrapped = leancompile.wrap(module)
    with torch.no_grad():
        wrapped(**inputs, return_dict=False)
    _update(wrapped, **inputs)
    records = {r.action: r.seconds for r in wrapped.last_calls}
    stats = wrapped.stats()
    assert set(records) == {"kept", "served"} and stats["served_calls"] == 1
    assert 0 < max(records.values()) < stats["compile_seconds"], (records, stats)
    with torch.no_grad():  # compiled: nothing more to count
        wrapped(**inputs, return_dict=False)
    assert wrapped.stats()["compile_seconds"] == 0.0


def test_an_engine_that_fails_leaves_the_loop_running_natively_and_says_why(monkeypatch):
    """Anything the engine cannot handle (here its per-row program raising mid-call) runs the module natively from
    then on: the loop's gradient is native's, and the warning and stats say why."""
    from leancompile.runtime.rowwise import RowwiseBackbone

    def broken(*_):
        raise RuntimeError("no kernel for this")

    monkeypatch.setattr(RowwiseBackbone, "forward", broken)
    module, inputs = _sd3()
    native = _update(module, **inputs)
    wrapped = leancompile.wrap(module)
    with pytest.warns(leancompile.NothingServedWarning, match="the engine failed .*no kernel for this"):
        with torch.no_grad():
            out = wrapped(**inputs, return_dict=False)[0]
    grads = _update(wrapped, **inputs)
    torch.testing.assert_close(grads, native, rtol=1e-10, atol=1e-12)
    stats = wrapped.stats()
    assert stats["served_calls"] == 0 and stats["recompute_reasons"] == {"unsupported": 1}, stats
    leancompile.unwrap(wrapped)
    with torch.no_grad():
        assert torch.equal(out, module(**inputs, return_dict=False)[0])


@pytest.mark.parametrize("head_dtype", [torch.float32, torch.float64])
def test_per_block_reweight_under_a_head_computing_in_float32_is_served_exact_to_its_precision(head_dtype):
    """FlowGRPO's update casts the transformer's output with ``.float()`` before its loss: over a float64 module the
    heads' cotangents carry float32's rounding, and per block too the span test allows that rounding, no more."""
    module, inputs = _sd3()
    advantages = torch.tensor([0.3, -1.7, 2.9], dtype=torch.float64)

    def loss(m, a):
        out = m(**inputs, return_dict=False)[0].to(head_dtype)
        return (a * out.square().mean((1, 2, 3))).sum().to(torch.float64)

    native = module
    native.zero_grad()
    loss(native, advantages).backward()
    expected = _grads(native)
    wrapped = leancompile.wrap(module, schedule="reweight", per_block=True)
    wrapped.zero_grad(set_to_none=True)
    with torch.no_grad():
        wrapped(**inputs, return_dict=False)
    wrapped.provisional(lambda a: loss(wrapped, torch.full((3,), a, dtype=torch.float64)))
    loss(wrapped, advantages).backward()
    stats = wrapped.stats()
    assert stats["served_calls"] > 0 and stats["recomputed_calls"] == 0, stats
    # SD3's qk-norm computes in float32 whatever the module's dtype: Reweight's combination rounds there too
    torch.testing.assert_close(_grads(wrapped), expected, rtol=1e-5, atol=1e-5 * expected.abs().max())


def test_rollouts_whose_update_serves_nothing_stop_being_kept_and_say_why():
    """The update calls the module on other inputs than the rollout's (here shifted latents): after two rollouts
    whose kept calls served nothing, nothing more is kept (the per-row program's time and the memory bought
    nothing), the loop runs natively, and the statistics and a warning say why."""
    module = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.GELU(), torch.nn.Linear(12, 6)).double()
    native = copy.deepcopy(module)
    wrapped = leancompile.wrap(module)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (wrapped, native)]
    x = torch.randn(4, 6, dtype=torch.float64)
    with pytest.warns(leancompile.NothingServedWarning) as caught:
        for _ in range(3):
            for m, optimizer in zip((wrapped, native), optimizers):
                with torch.no_grad():
                    m(x)
                m(x + 1).square().sum().backward()
                optimizer.step()
                optimizer.zero_grad()
    assert any("served none of the calls kept in the last 2 rollouts" in str(w.message) for w in caught)
    stats = wrapped.stats()
    assert "inputs" in stats["stopped"] and stats["served_calls"] == 0
    assert stats["recompute_reasons"]["stopped"] == 1  # the third update's call, run natively outside the engine
    assert [r.action for r in wrapped.last_calls] == []  # the third rollout's call was not kept
    for p, q in zip(wrapped.parameters(), native.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=0)
