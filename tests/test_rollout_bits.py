"""A kept call returns the module's own bits: the rollout of a wrapped module is native's, in float32 and under
bf16 autocast, whole-call and per block, for the three diffusers families and a causal LM.

The per-row program's forward runs the kernels eager runs at the call's batch (``passes.eager_bits``): at several
rows a linear layer's input is laid out otherwise than at one row (Flux's attention output is a slice, copied by
``contiguous()``), a batch-shaped constant is made per row (Flux's guidance), and vmap's own ``addmm`` rule adds the
bias after rounding the product; each of these moved the rollout off native's bits."""
import copy

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import leancompile
from leancompile import backbones

PRECISIONS = {"float32": None, "bf16": torch.bfloat16}


def _autocast(precision):
    dtype = PRECISIONS[precision]
    return torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def _kept_and_native(module, args, kwargs, precision, per_block, output=lambda out: out):
    native = copy.deepcopy(module)
    wrapped = leancompile.wrap(module, per_block=per_block)
    with torch.no_grad(), _autocast(precision):
        expected = output(native(*args, **kwargs))
        got = output(wrapped(*args, **kwargs))
    assert wrapped.stats()["retained_bytes"] > 0, "the call was not kept: it ran natively"
    return got, expected


def _with_lora(backbone):
    """peft's LoRA layers on ``backbone``: frozen base weights beside trainable adapters (eager picks a linear
    layer's kernels by whether its weight requires grad)."""
    from peft import LoraConfig, get_peft_model

    backbone.model = get_peft_model(backbone.model, LoraConfig(r=2, lora_alpha=2, init_lora_weights="gaussian",
                                                               target_modules=backbone.lora_target_modules()))
    return backbone


@pytest.mark.parametrize("per_block", [False, True], ids=["whole", "per-block"])
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("family", ["flux", "sd3", "wan"])
def test_a_kept_diffusers_call_returns_natives_bits(family, precision, per_block):
    """Flux with LoRA adapters (one block of each kind, to compile quickly); SD3 and Wan fully trainable."""
    if family == "flux":
        backbone = _with_lora(backbones.tiny("flux", seed=1, num_layers=1, num_single_layers=1))
    else:
        backbone = backbones.tiny(family, seed=1)
    backbone.eval()
    rows = 3  # several rows: at one row the per-row program is the module's own partition
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(rows, *backbone.latent_shape, generator=generator)
    sigma = torch.rand(rows, generator=generator)
    cond = backbone.dummy_conditioning(rows, generator=generator)
    got, expected = _kept_and_native(backbone, (x, sigma, cond), {}, precision, per_block)
    assert got.dtype == expected.dtype
    assert torch.equal(got, expected), (got - expected).abs().max()


def _causal_lm() -> torch.nn.Module:
    torch.manual_seed(3)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


@pytest.mark.parametrize("per_block", [False, True], ids=["whole", "per-block"])
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_a_kept_causal_lm_call_returns_natives_bits(precision, per_block):
    model = _causal_lm().eval()  # Qwen2: Llama's layers with biased q/k/v projections
    ids = torch.randint(0, 32, (3, 10), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0  # a padded row
    got, expected = _kept_and_native(model, (), dict(input_ids=ids, attention_mask=mask, use_cache=False),
                                     precision, per_block, output=lambda out: out.logits)
    assert torch.equal(got, expected), (got.float() - expected.float()).abs().max()


def test_the_rows_of_a_linear_layer_are_one_product_as_eager_runs_them():
    """The traced forward over R rows runs each linear layer as eager does at R rows: one ``addmm`` over the rows
    flattened, the bias added inside it (vmap's own rule adds it after rounding the product)."""
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    wrapped = leancompile.wrap(module, tune_matmuls=False)
    x = torch.randn(4, 5, 8)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = module(x), wrapped(x)
    assert torch.equal(got, expected)
    graph = wrapped.engine.rowwise[1.0].forward_graph.graph
    products = [n for n in graph.nodes if n.op == "call_function" and n.target in (
        torch.ops.aten.addmm.default, torch.ops.aten.mm.default, torch.ops.aten.bmm.default)]
    assert [n.target for n in products] == [torch.ops.aten.addmm.default] * 2
    assert all(n.args[1].meta["val"].shape[0] == 4 * 5 for n in products)


class _Conv1D(torch.nn.Module):
    """A layer that calls ``addmm`` itself (transformers' GPT-2 ``Conv1D``)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(32, 48))
        self.bias = torch.nn.Parameter(torch.randn(48))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], 48)


def test_an_addmm_the_module_calls_stays_one_addmm_over_the_rows():
    """vmap's rule for ``addmm`` rounds the product to bf16 before adding the bias; ``fuse_biases_into_products``
    makes it eager's one ``addmm`` over the rows again."""
    torch.manual_seed(0)
    module = _Conv1D().bfloat16()
    native, wrapped = copy.deepcopy(module), leancompile.wrap(module)
    x = torch.randn(3, 10, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        expected, got = native(x), wrapped(x)
    assert torch.equal(got, expected)
    graph = wrapped.engine.rowwise[1.0].forward_graph.graph
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.addmm.default in targets and torch.ops.aten.mm.default not in targets


def test_the_digits_runs_first_step_is_natives_to_the_bit_in_float32():
    """The benchmark's digits run (``benchmarks.equivalence``): its first step's rollout, samples and rewards, is
    native's bit for bit; no served gradient has moved the weights yet (later steps drift by the backward's rounding,
    docs/equivalence-bits.md)."""
    from benchmarks.equivalence import PROMPTS, _trainer

    native, auto = _trainer("float32"), leancompile.optimize(_trainer("float32"))
    native.step(PROMPTS)
    stats = auto.step(PROMPTS)
    assert auto.plan.schedule in ("retain", "reweight") and stats["served_calls"] > 0
    assert torch.equal(native.last_rollout.latents, auto.last_rollout.latents)
    assert torch.equal(native.last_rollout.rewards, auto.last_rollout.rewards)
