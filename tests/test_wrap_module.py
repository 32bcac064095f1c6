"""``leancompile.wrap`` on modules as frameworks hold and call them: the wrapped module stays the module, a call is
its bound call, a forward assigned on it still runs through the engine, an output that is not one row-laid tensor
is served through the submodule that computes its rows, and a loop that gains nothing is told so."""
import copy
import sys
import types
import warnings

import pytest
import torch

import leancompile
from leancompile import backbones
from leancompile.runtime import auto

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


def test_auto_measures_the_program_against_native_and_runs_natively_where_it_is_slower(monkeypatch):
    """Native's time per row measured beside the program is made a thousandth of a nanosecond here, so that the
    program is slower whatever the machine: after the first optimizer step that followed served calls, auto keeps
    nothing more, says why, and the loop's gradient stays native's."""
    for timed in ("forward_seconds", "update_seconds"):
        monkeypatch.setattr(sys.modules["leancompile.wrapping.wrap_runtime"], timed, lambda *_: 1e-12)
    monkeypatch.setattr(auto, "AUTO_FLOOR", FLOOR)  # the suite's own is 0 (conftest)
    module, inputs = _sd3()
    wrapped = leancompile.wrap(module, schedule="auto")
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=1e-3)
    with torch.no_grad():
        wrapped(**inputs, return_dict=False)
    _update(wrapped, **inputs)
    with pytest.warns(leancompile.NothingServedWarning, match="auto: this step's 3 kept and 3 served rows took the"):
        optimizer.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error", leancompile.NothingServedWarning)  # said once
        with torch.no_grad():
            wrapped(**inputs, return_dict=False)
        _update(wrapped, **inputs)
        optimizer.step()
    notes = [r for r in wrapped.last_calls if r.kind == "auto"]
    assert len(notes) == 1 and "runs natively from now on" in notes[0].reason
    stats = wrapped.stats()
    assert stats["served_calls"] == 1 and stats["recompute_reasons"] == {"freed": 1}, stats
    assert "runs natively from now on" in stats["stopped"]
    grads = _update(wrapped, **inputs)
    leancompile.unwrap(wrapped)
    torch.testing.assert_close(grads, _update(module, **inputs), rtol=1e-10, atol=1e-12)


def test_auto_keeps_serving_where_the_program_is_not_slower(monkeypatch):
    for timed in ("forward_seconds", "update_seconds"):
        monkeypatch.setattr(sys.modules["leancompile.wrapping.wrap_runtime"], timed, lambda *_: 1e6)
    monkeypatch.setattr(auto, "AUTO_FLOOR", FLOOR)
    module, inputs = _sd3()
    wrapped = leancompile.wrap(module, schedule="auto")
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=1e-3)
    for _ in range(2):
        with torch.no_grad():
            wrapped(**inputs, return_dict=False)
        _update(wrapped, **inputs)
        optimizer.step()
    notes = [r.reason for r in wrapped.last_calls if r.kind == "auto"]  # read before stats() clears them
    assert len(notes) == 2 and all("the compile took" in n and "repaid after" in n for n in notes), notes
    assert wrapped.stats()["served_calls"] == 2


def test_auto_counts_a_compile_that_recurs_at_every_step(monkeypatch):
    """TRL calls transformers' ``enable_input_require_grads`` at every step, which adds one more hook to the
    embeddings each time: the module's state differs at each step, and each step compiles a program again. auto
    counts that compile in the second step it weighs (the first step's is paid once) and runs natively."""
    runtime = sys.modules["leancompile.wrapping.wrap_runtime"]
    monkeypatch.setattr(runtime, "program_seconds_per_row", lambda records, action: 0.01)
    monkeypatch.setattr(runtime, "forward_seconds", lambda *_: 0.005 * 3)  # the program saves 45 ms a step
    monkeypatch.setattr(runtime, "update_seconds", lambda *_: 0.03 * 3)
    monkeypatch.setattr(auto, "AUTO_FLOOR", FLOOR)
    module, inputs = _sd3()
    wrapped = leancompile.wrap(module, schedule="auto")
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=1e-3)
    caught = []
    for step in range(2):
        module.pos_embed.register_forward_hook(lambda m, args, out: None)  # one more each step
        with torch.no_grad():
            wrapped(**inputs, return_dict=False)
        _update(wrapped, **inputs)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            optimizer.step()
        caught += [str(w.message) for w in said if "auto:" in str(w.message)]
        assert (wrapped.stats()["stopped"] is None) == (step == 0)
    assert len(caught) == 1 and "s compiling again" in caught[0], caught




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


@pytest.mark.parametrize("rollout_calls, stops", [(1, False), (5, True)])
def test_auto_prices_every_kept_row_against_the_rows_served(monkeypatch, rollout_calls, stops):
    """auto prices the step as the loop runs it: each row the rollout kept costs the program's forward instead of
    native's, and only the rows the update served save native's forward and backward. Per row here the program
    takes 1 s to keep and 1 s to serve, native 0.5 s forward and 3 s forward and backward: one kept call per served
    call saves time (6 s against 10.5 s), five cost it (18 s against 16.5 s)."""
    runtime = sys.modules["leancompile.wrapping.wrap_runtime"]
    monkeypatch.setattr(runtime, "program_seconds_per_row", lambda records, action: 1.0)
    monkeypatch.setattr(runtime, "forward_seconds", lambda *_: 0.5 * 3)  # the calls have 3 rows
    monkeypatch.setattr(runtime, "update_seconds", lambda *_: 3.0 * 3)
    monkeypatch.setattr(auto, "AUTO_FLOOR", FLOOR)
    module, inputs = _sd3()
    wrapped = leancompile.wrap(module, schedule="auto")
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=1e-3)
    with torch.no_grad():  # the rollout's steps, at other timesteps but the first
        for step in range(rollout_calls):
            wrapped(**{**inputs, "timestep": inputs["timestep"] + step}, return_dict=False)
    _update(wrapped, **inputs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    stopped = wrapped.stats()["stopped"]
    assert (stopped is not None) == stops, stopped
    said = [str(w.message) for w in caught if "auto:" in str(w.message)]
    assert len(said) == stops and all(f"{3 * rollout_calls} kept and 3 served rows" in m for m in said), said


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
    assert [r.action for r in wrapped.last_calls] == []  # the third rollout's call was not kept
    for p, q in zip(wrapped.parameters(), native.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=0)
