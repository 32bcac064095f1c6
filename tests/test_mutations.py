"""The mutation suite: between a kept call (a rollout's, without grad) and a later call (with grad or without),
one of the ways PyTorch code changes what a module computes is applied; the later call is then either served, with
outputs and gradients equal to those of an unwrapped copy of the module given the same mutation, or recomputed with
a reason that names the change. Never a silent difference, never a crash (the engine's "failed" warning is an
error here).

The modules: the three tiny diffusers backbones (Flux, SD3, Wan) and a tiny causal LM, each in float64 with two
peft LoRA adapters ("default" active, "second" not; LoRA dropout p > 0, inactive in eval), built once per test
module. Each example wraps a deepcopy; the wrapped copies of one module share their compiled per-row programs (the
weights are the programs' inputs; a program is found by the call's state, so sharing them is what one module would
do), which keeps the suite's time to the programs' first compile per module.

The weight-value kinds (writes through ``.data``, ``set_``, ``load_state_dict``, EMA swaps, ...) are seen by the
digest of the weights' values each kept call holds (leancompile.runtime.digest), compared at every answer.
"""
from __future__ import annotations

import copy
import re
import warnings
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.tuners_utils import BaseTunerLayer

import leancompile
from leancompile import backbones

DTYPE = torch.float64
BATCH = 3
FAMILIES = ("flux", "sd3", "wan")
CASES = (*FAMILIES, "lm")


# ---------------------------------------------------------------------------------------------------- modules


@dataclass
class Case:
    """One module (unwrapped, never called wrapped), the kwargs of its call, and the programs its wrapped copies
    share."""

    name: str
    module: torch.nn.Module
    inputs: dict
    programs: dict = field(default_factory=dict)


def _lora(targets: list[str], model: torch.nn.Module) -> None:
    """Two adapters, "default" active; their B drawn (peft's gaussian init zeroes B: a no-op adapter)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for name in ("default", "second"):
            inject_adapter_in_model(LoraConfig(r=2, lora_alpha=4, lora_dropout=0.1, target_modules=targets,
                                               init_lora_weights="gaussian"), model, adapter_name=name)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0.0, 0.1)
    _set_adapter(model, "default")


def _set_adapter(model: torch.nn.Module, name: str) -> None:
    """peft's ``set_adapter`` on every LoRA layer (what diffusers' and transformers' ``set_adapter`` do)."""
    for _, layer in _lora_layers(model):
        layer.set_adapter(name)


def _diffusers(family: str) -> Case:
    bb = backbones.tiny(family, seed=0, dtype=DTYPE)
    model = bb.model
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, *bb.latent_shape, generator=generator, dtype=DTYPE)
    sigma = torch.tensor([0.2, 0.5, 0.8], dtype=DTYPE)
    cond = bb.dummy_conditioning(BATCH, generator, dtype=DTYPE)
    inputs, forward = {}, model.forward
    model.forward = lambda *args, **kwargs: inputs.update(kwargs) or forward(*args, **kwargs)  # the call's kwargs
    with torch.no_grad():
        bb(x, sigma, cond)
    del model.forward
    _lora(bb.lora_target_modules(), model)
    return Case(family, model.eval(), inputs)


def _lm() -> Case:
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=16, pad_token_id=0)).to(DTYPE)
    ids = torch.randint(1, 16, (BATCH, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = 0, 0  # one left-padded row
    _lora(["q_proj", "v_proj"], model)
    return Case("lm", model.eval(), dict(input_ids=ids, attention_mask=mask, use_cache=False))


@pytest.fixture(scope="module")
def cases():
    """The modules, each built at its first use."""
    built = {}

    def get(name: str) -> Case:
        if name not in built:
            built[name] = _lm() if name == "lm" else _diffusers(name)
        return built[name]

    return get


def _output(result) -> torch.Tensor:
    return result[0] if isinstance(result, tuple) else result.logits


def _rows(inputs: dict, order: list[int]) -> dict:
    """The call with its rows in ``order`` (tensors every row shares, such as Flux's ids, as they are)."""
    index = torch.tensor(order)
    return {k: v.index_select(0, index) if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == BATCH else v
            for k, v in inputs.items()}


# -------------------------------------------------------------------------------------------------- mutations


def _pick(items: list, choice: int):
    assert items
    return items[choice % len(items)]


def _noise(t: torch.Tensor, choice: int, scale: float = 0.05) -> torch.Tensor:
    generator = torch.Generator().manual_seed(choice)
    return scale * torch.randn(t.shape, generator=generator, dtype=torch.float64).to(t.dtype)


def _parameter(m, choice, trainable: bool | None = None, rows: bool = False) -> tuple[str, torch.nn.Parameter]:
    named = sorted((n, p) for n, p in m.named_parameters()
                   if (trainable is None or p.requires_grad == trainable) and (not rows or p.dim() == 2))
    return _pick(named, choice)


def _owner(m, name: str) -> tuple[torch.nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (m.get_submodule(path) if path else m), leaf


def _linear(m, choice) -> tuple[str, torch.nn.Linear]:
    """A plain ``nn.Linear`` the forward calls with one positional tensor (a LoRA layer's base layer, a projection)."""
    return _pick(sorted((n, s) for n, s in m.named_modules() if type(s) is torch.nn.Linear), choice)


def _lora_layers(m) -> list[tuple[str, BaseTunerLayer]]:
    return sorted((n, s) for n, s in m.named_modules() if isinstance(s, BaseTunerLayer))


# Each mutation: (module, choice, call) -> None, applied alike to the wrapped module and to its unwrapped copy;
# ``call()`` makes a call without grad of the module in between (an EMA swap's evaluation), its output compared too.

def data_copy(m, choice, call):
    _, p = _parameter(m, choice)
    p.data.copy_(p.data + _noise(p, choice))


def sign_flip(m, choice, call):
    _, p = _parameter(m, choice, rows=True)
    p.data.mul_(-1)


def row_permutation(m, choice, call):
    """Rows of a weight permuted (its norm, and every other per-tensor statistic, kept)."""
    _, p = _parameter(m, choice, rows=True)
    order = torch.randperm(p.shape[0], generator=torch.Generator().manual_seed(choice))
    if torch.equal(order, torch.arange(p.shape[0])):
        order = order.roll(1)
    p.data.copy_(p.data[order])


def set_(m, choice, call):
    _, p = _parameter(m, choice)
    with torch.no_grad():
        p.set_(p.detach() + _noise(p, choice))


def data_set_(m, choice, call):
    _, p = _parameter(m, choice)
    p.data.set_(p.detach() + _noise(p, choice))


def copy_without_grad(m, choice, call):
    _, p = _parameter(m, choice)
    with torch.no_grad():
        p.copy_(p + _noise(p, choice))


def data_assigned(m, choice, call):
    _, p = _parameter(m, choice)
    p.data = p.detach() + _noise(p, choice)


def dtype_round_trip(m, choice, call):
    """``.to(float32).to(float64)``: every weight rounded, through ``.data``, dtypes as they were."""
    m.to(torch.float32).to(DTYPE)


def load_state_dict(m, choice, call):
    name, p = _parameter(m, choice)
    state = m.state_dict()
    key = next(k for k, v in state.items() if v.data_ptr() == p.data_ptr())
    state[key] = state[key] + _noise(p, choice)
    m.load_state_dict(state)


def ema_swap(m, choice, call):
    """Other weights copied in through ``.data``, a call, the weights copied back: the later call is served."""
    trainable = [p for p in m.parameters() if p.requires_grad]
    saved = [p.data.clone() for p in trainable]
    for i, p in enumerate(trainable):
        p.data.copy_(p.data + _noise(p, choice + i))
    call()
    for p, value in zip(trainable, saved):
        p.data.copy_(value)


def parameter_replaced(m, choice, call):
    name, p = _parameter(m, choice)
    owner, leaf = _owner(m, name)
    setattr(owner, leaf, torch.nn.Parameter(p.detach() + _noise(p, choice), requires_grad=p.requires_grad))


def buffer_replaced(m, choice, call):
    """A buffer (a position embedding, a rope cache) reassigned."""
    name, b = _pick(sorted((n, b) for n, b in m.named_buffers() if b.is_floating_point()), choice)
    owner, leaf = _owner(m, name)
    setattr(owner, leaf, b * 1.01 + 0.01)


def adapters_disabled(m, choice, call):
    for _, layer in _lora_layers(m):
        layer.enable_adapters(False)


def adapter_switched(m, choice, call):
    _set_adapter(m, "second")


def adapter_scaled(m, choice, call):
    """One layer's scaling through ``set_scale``, or every layer's through its scaling dict."""
    layers = _lora_layers(m)
    if choice % 2:
        _pick(layers, choice // 2)[1].set_scale("default", 0.5)
    else:
        for _, layer in layers:
            layer.scaling["default"] *= 0.5


def adapter_merged(m, choice, call):
    for _, layer in _lora_layers(m):
        layer.merge()


def requires_grad_toggled(m, choice, call):
    _, p = _parameter(m, choice)
    p.requires_grad_(not p.requires_grad)


def train_mode(m, choice, call):
    """``train()``: the LoRA dropout (p > 0) now drops."""
    m.train()


def to_dtype(m, choice, call):
    """The module cast to float32; the call's floating inputs are cast alike (see _later)."""
    m.to(torch.float32)


def forward_hook(m, choice, call):
    _linear(m, choice)[1].register_forward_hook(lambda module, args, output: output * 1.5)


def forward_pre_hook(m, choice, call):
    _linear(m, choice)[1].register_forward_pre_hook(lambda module, args: (args[0] * 1.5, *args[1:]))


def backward_hook(m, choice, call):
    _linear(m, choice)[1].register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 1.5,))


class _Scaled(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * 1.5


def submodule_wrapped(m, choice, call):
    """A linear layer put inside a module of the test's (its parameters the same tensors)."""
    name, linear = _linear(m, choice)
    owner, leaf = _owner(m, name)
    setattr(owner, leaf, _Scaled(linear))


def submodule_replaced(m, choice, call):
    name, linear = _linear(m, choice)
    owner, leaf = _owner(m, name)
    new = torch.nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, dtype=DTYPE)
    with torch.no_grad():
        for mine, theirs in zip(new.parameters(), linear.parameters()):
            mine.copy_(theirs + _noise(theirs, choice))
            mine.requires_grad_(theirs.requires_grad)
    setattr(owner, leaf, new)


_EPSILONS = ("eps", "variance_epsilon")


def attribute(m, choice, call):
    """A plain float the forward reads: a norm's epsilon."""
    norms = sorted((n, s, a) for n, s in m.named_modules() for a in _EPSILONS
                   if isinstance(s.__dict__.get(a), float) and a in type(s).forward.__code__.co_names)
    _, norm, name = _pick(norms, choice)
    setattr(norm, name, 0.25)


def autocast(m, choice, call):
    """The later call under autocast (see _later)."""


def nothing(m, choice, call):
    """No change: the later call is served."""


@dataclass(frozen=True)
class Kind:
    mutate: object
    reason: str  # what a recompute's reason must say (a regular expression, case-insensitive)
    served: bool = False  # the later call must be served
    applies: tuple = CASES


WRITTEN = r"weight|written"

WEIGHT_KINDS = {
    "data copy_": Kind(data_copy, WRITTEN),
    "data sign flip": Kind(sign_flip, WRITTEN),
    "data row permutation": Kind(row_permutation, WRITTEN),
    "set_": Kind(set_, WRITTEN),
    "data set_": Kind(data_set_, WRITTEN),
    "copy_ without grad": Kind(copy_without_grad, WRITTEN),
    "data assigned": Kind(data_assigned, WRITTEN),
    "to(dtype) round trip": Kind(dtype_round_trip, WRITTEN),
    "load_state_dict": Kind(load_state_dict, WRITTEN),
    "EMA swap": Kind(ema_swap, "", served=True),
}

STATE_KINDS = {
    "nothing": Kind(nothing, "", served=True),
    "parameter replaced": Kind(parameter_replaced, r"parameter .* replaced"),
    "buffer replaced": Kind(buffer_replaced, r"buffer .* replaced", applies=("sd3", "wan", "lm")),
    "adapters disabled": Kind(adapters_disabled, r"adapters are (enabled or )?disabled"),
    "adapter switched": Kind(adapter_switched, r"active adapter"),
    "adapter scaled": Kind(adapter_scaled, r"adapter scaling"),
    "adapter merged": Kind(adapter_merged, r"merged"),
    "requires_grad_ toggled": Kind(requires_grad_toggled, r"requires grad"),
    "train()": Kind(train_mode, r"train mode"),
    # (the backbones' floating inputs are cast too: their rows are not the kept ones)
    "to(dtype)": Kind(to_dtype, r"dtype|no kept call has these inputs"),
    "forward hook": Kind(forward_hook, r"forward hook"),
    "forward pre-hook": Kind(forward_pre_hook, r"forward pre-hook"),
    "backward hook": Kind(backward_hook, r"backward hook"),
    "submodule wrapped": Kind(submodule_wrapped, r"submodule .* replaced"),
    "submodule replaced": Kind(submodule_replaced, r"submodule .* replaced"),
    "attribute": Kind(attribute, r"attribute .*(eps|variance_epsilon)"),
    "autocast": Kind(autocast, r"autocast"),
}


# ------------------------------------------------------------------------------------------------------ check


def _later(module, kind: str, inputs: dict, grad: bool):
    """The later call: output and, with grad, every trainable parameter's gradient (by name; zeros where None)."""
    if kind == "to(dtype)":
        inputs = {k: v.to(torch.float32) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                  for k, v in inputs.items()}
    module.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # train(): both draw the same dropout masks where they run natively
    with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "autocast"):
        out = _output(module(**inputs))
        if grad and out.requires_grad:  # (adapters disabled or merged: nothing that requires grad is used)
            weights = torch.linspace(-1.0, 2.0, out.numel(), dtype=out.dtype).reshape(out.shape)
            (out * weights).sum().backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in module.named_parameters()
             if p.requires_grad} if grad else {}
    return out.detach(), grads


def check(case: Case, kind: str, grad: bool, choice: int, order: list[int]) -> None:
    spec = {**WEIGHT_KINDS, **STATE_KINDS}[kind]
    module, reference = copy.deepcopy(case.module), copy.deepcopy(case.module)
    with warnings.catch_warnings():
        warnings.simplefilter("error", leancompile.NothingServedWarning)  # the engine failing is a crash here
        wrapped = leancompile.wrap(module, trained=lambda n: n == 0)  # the rollout's first call is kept
        wrapped.engine.rowwise[1.0]._programs = case.programs
        with torch.no_grad():
            wrapped(**case.inputs)
        assert [r.action for r in wrapped.last_calls] == ["kept"], wrapped.last_calls
        wrapped.stats()
        between = {"wrapped": [], "reference": []}

        def call_of(m, key):
            def call():
                with torch.no_grad():
                    between[key].append(_output(m(**case.inputs)))
            return call

        spec.mutate(wrapped, choice, call_of(wrapped, "wrapped"))
        spec.mutate(reference, choice, call_of(reference, "reference"))
        inputs = _rows(case.inputs, order)
        out, grads = _later(wrapped, kind, inputs, grad)
        records = [r for r in wrapped.last_calls if r.action in ("served", "served values", "recomputed")]
    expected, got = _later(reference, kind, inputs, grad)
    for mine, theirs in zip(between["wrapped"], between["reference"], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12, msg=f"{kind}: the call in between")
    what = f"{kind} ({case.name}, {'with' if grad else 'without'} grad): {records}"
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what}: output\n{m}")
    assert grads.keys() == got.keys(), what
    for name in got:
        torch.testing.assert_close(grads[name], got[name], rtol=1e-10, atol=1e-12,
                                   msg=lambda m: f"{what}: gradient of {name}\n{m}")
    for record in records:
        if record.action == "recomputed":
            assert spec.reason and re.search(spec.reason, record.reason, re.IGNORECASE), what
    if spec.served:
        assert records and all(r.action.startswith("served") for r in records), what


def _applicable(kinds: dict) -> list:
    return [(name, case) for name, spec in kinds.items() for case in spec.applies]


EXAMPLES = settings(max_examples=1, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _explore(cases, kind: str, module: str, data) -> None:
    """One drawn example of ``kind`` on ``module``: with grad or without, which tensor or submodule it changes,
    the later call's row order."""
    grad = data.draw(st.booleans(), label="grad")
    choice = data.draw(st.integers(0, 2**16), label="choice")
    order = data.draw(st.permutations(range(BATCH)), label="rows")
    check(cases(module), kind, grad, choice, list(order))


# Every kind on every module it applies to
@pytest.mark.parametrize("kind, module", _applicable(STATE_KINDS))
@EXAMPLES
@given(data=st.data())
def test_a_change_of_the_modules_state_is_served_exact_or_recomputed_naming_it(cases, kind, module, data):
    _explore(cases, kind, module, data)


@pytest.mark.parametrize("kind, module", _applicable(WEIGHT_KINDS))
@EXAMPLES
@given(data=st.data())
def test_a_write_of_weight_values_is_served_exact_or_recomputed_naming_it(cases, kind, module, data):
    _explore(cases, kind, module, data)


@pytest.mark.fast
@pytest.mark.parametrize("kind", [*STATE_KINDS, *WEIGHT_KINDS])
def test_each_kind_once_on_flux(cases, kind):
    applies = {**WEIGHT_KINDS, **STATE_KINDS}[kind].applies
    check(cases("flux" if "flux" in applies else applies[0]), kind, grad=True, choice=0, order=[2, 0, 1])
