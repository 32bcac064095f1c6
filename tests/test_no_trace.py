"""A failure of the engine leaves no trace: whatever stage raises (the one-row trace, its partition, the traced rows'
compile, a keep, a served forward or backward), the module is as it was (its parameters, buffers, submodules, hooks
and attributes), the loop's call runs natively, a warning names the failure, and every later call, with grad or
without, is an unwrapped copy's bit for bit. And a wrapped loop prints no warning of torch's."""
import copy
import warnings

import pytest
import torch

import leancompile
from leancompile import backbones
from leancompile.runtime import engine, retain, rowwise
from leancompile.wrapping.wrapped import RUNTIME


def _wan():
    backbone = backbones.tiny("wan", seed=0, dtype=torch.float64)
    text = backbone.dummy_conditioning(2, torch.Generator().manual_seed(1), dtype=torch.float64)
    latents = torch.randn(2, *backbone.latent_shape, generator=torch.Generator().manual_seed(2),
                          dtype=torch.float64)
    inputs = dict(hidden_states=latents, timestep=torch.tensor([500.0, 300.0], dtype=torch.float64),
                  encoder_hidden_states=text.text)
    return backbone.model, inputs


def _loop(module, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The rollout's call in eval() without grad and the update's in train() with grad: the rollout's output and
    the update's gradients."""
    module.eval()
    with torch.no_grad():
        out = module(**inputs, return_dict=False)[0]
    module.train()
    module.zero_grad(set_to_none=True)
    module(**inputs, return_dict=False)[0].square().sum().backward()
    return out, torch.cat([p.grad.flatten() for p in module.parameters()])


def _members(module) -> list:
    """Every submodule's class and ``__dict__`` by identity, its dicts' entries too (parameters, buffers, submodules,
    hooks)."""
    return [(name, type(m), {k: (id(v), sorted((str(a), id(b)) for a, b in v.items()) if isinstance(v, dict) else 0)
                             for k, v in m.__dict__.items()})
            for name, m in module.named_modules()]


def _breaking(module, stage: str):
    """A stand-in for a stage's function that raises; at the stages that swap the module's tensors (the trace, its
    partition, the compile: functional calls over fake or functional weights) it first changes the module as a
    half-done trace would. The later stages run the compiled program on the weights as inputs and write nothing to
    the module (a per-call snapshot of a model of a thousand submodules would cost a forward's time)."""
    def broken(*_, **__):
        if stage in MUTATING:
            module.rope.register_buffer("freqs_cos", torch.zeros(1))
            module.injected = True
            module.blocks[0].register_forward_hook(lambda *_: None)
            module.blocks[1] = torch.nn.Identity()
        raise RuntimeError(f"injected at {stage}")
    return broken


MUTATING = ("trace", "partition", "compile")


# Where each stage's work happens: (owner, attribute) to break; _Served.forward is a static method
STAGES = {"trace": (rowwise, "keeping_whole"), "partition": (rowwise, "random_operators"),
          "compile": (rowwise, "make_fx"), "keep": (retain.Retain, "keep"),
          "served forward": (engine._Served, "forward"), "served backward": (retain.Retain, "gradients")}


@pytest.fixture(autouse=True)
def compiled_here(monkeypatch):
    """Each stage runs for real: no program is read from the cache past the failure injected into it."""
    monkeypatch.setenv("LEANCOMPILE_CACHE", "0")


@pytest.mark.parametrize("stage", ["trace", "partition", "compile", "keep",
                                   pytest.param("served forward", marks=pytest.mark.fast), "served backward"])
def test_a_failure_at_any_stage_leaves_the_module_as_it_was_and_runs_it_natively(monkeypatch, stage):
    module, inputs = _wan()
    native = copy.deepcopy(module)
    wrapped = leancompile.wrap(module)
    before = _members(module)
    owner, name = STAGES[stage]
    broken = _breaking(module, stage)
    monkeypatch.setattr(owner, name, staticmethod(broken) if owner is engine._Served else broken)
    with pytest.warns(leancompile.NothingServedWarning, match=f"injected at {stage}"):
        out, grads = _loop(wrapped, inputs)
    assert _members(module) == before
    expected_out, expected = _loop(native, inputs)
    assert torch.equal(out, expected_out) and torch.equal(grads, expected)
    for _ in range(2):  # later calls: the module's own
        out, grads = _loop(wrapped, inputs)
        expected_out, expected = _loop(native, inputs)
        assert torch.equal(out, expected_out) and torch.equal(grads, expected)
    assert _members(module) == before
    assert module.__dict__[RUNTIME].engine is not None


@pytest.mark.fast
def test_a_wrapped_loop_prints_no_warning_of_torchs():
    """Only leancompile's own warnings reach the user: not torch's pytree ``LeafSpec`` deprecation (a traced graph
    copied), nor vmap's fallback."""
    module, inputs = _wan()
    wrapped = leancompile.wrap(module)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            _loop(wrapped, inputs)
            optimizer.step()
    assert wrapped.stats()["served_calls"] == 2
    assert not [w for w in caught if not issubclass(w.category, leancompile.NothingServedWarning)], \
        [str(w.message) for w in caught]
