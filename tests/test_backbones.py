import pytest
import torch
from peft import LoraConfig
from torch.fx.experimental.proxy_tensor import make_fx

from leancompile.backbones import Backbone, Conditioning, build, load_config, real, tiny

FAMILIES = ["flux", "sd3", "wan"]


def _inputs(bb: Backbone, batch: int = 2, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((batch, *bb.latent_shape), generator=g).to(dtype)
    sigma = torch.rand(batch, generator=g).to(dtype)
    cond = bb.dummy_conditioning(batch, generator=g, dtype=dtype)
    return x, sigma, cond


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    # The tiny models' ops are far too small to gain from intra-op threads, and on a busy machine
    # OpenMP workers waiting on each other make them up to 100x slower.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


# ---------------------------------------------------------------------------------------------
# Conditioning


def test_conditioning_ops():
    text, pooled = torch.randn(3, 4, 5), torch.randn(3, 6)
    c = Conditioning(text, pooled)
    assert c.batch_size == 3
    sel = c.index(torch.tensor([2, 0]))
    assert torch.equal(sel.text, text[[2, 0]]) and torch.equal(sel.pooled, pooled[[2, 0]])
    assert c.index(slice(1, 3)).batch_size == 2
    rep = c.repeat_interleave(2)
    assert rep.batch_size == 6 and torch.equal(rep.text[1], text[0]) and torch.equal(rep.pooled[5], pooled[2])
    cat = Conditioning.cat([c, sel])
    assert cat.batch_size == 5 and torch.equal(cat.text[3:], sel.text)
    assert c.to(torch.float64).text.dtype == torch.float64 and c.to(torch.float64).pooled.dtype == torch.float64
    nopool = Conditioning(text, None)
    assert nopool.index(slice(0, 1)).pooled is None and nopool.repeat_interleave(2).pooled is None
    assert Conditioning.cat([nopool, nopool]).pooled is None
    with pytest.raises(ValueError, match="parts"):
        Conditioning.cat([c, nopool])
    with pytest.raises(ValueError, match="parts"):
        Conditioning.cat([])


# ---------------------------------------------------------------------------------------------
# Tiny backbones


def test_tiny_shapes_and_sizes(family):
    bb = tiny(family)
    expected_latent = {"flux": (4, 8, 8), "sd3": (4, 8, 8), "wan": (4, 2, 8, 8)}[family]
    assert bb.family == family and bb.latent_shape == expected_latent and bb.text_shape == (8, 32)
    assert bb.pooled_dim == (None if family == "wan" else 16)
    assert dict(bb.named_children())["model"] is bb.model
    n = sum(p.numel() for p in bb.parameters())
    assert 10_000 < n < 3_000_000, n


def test_forward_shape_dtype(family):
    bb = tiny(family)
    x, sigma, cond = _inputs(bb)
    y = bb(x, sigma, cond)
    assert y.shape == x.shape and y.dtype == x.dtype and torch.isfinite(y).all()


def test_forward_float64(family):
    bb = tiny(family, dtype=torch.float64)
    assert next(bb.parameters()).dtype == torch.float64
    x, sigma, cond = _inputs(bb, dtype=torch.float64)
    y = bb(x, sigma, cond)
    assert y.dtype == torch.float64 and y.shape == x.shape and torch.isfinite(y).all()
    # float64 and float32 agree up to float32 rounding
    y32 = tiny(family)(x.float(), sigma.float(), cond.to(torch.float32))
    torch.testing.assert_close(y.float(), y32, rtol=1e-3, atol=1e-4)


# diffusers' RMSNorm keeps float32 weights under autocast; torch warns it cannot fuse that.
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_forward_bf16_autocast(family):
    bb = tiny(family)
    x, sigma, cond = _inputs(bb)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = bb(x, sigma, cond)
    assert y.dtype == x.dtype and y.shape == x.shape and torch.isfinite(y).all()
    ref = bb(x, sigma, cond)
    assert (y - ref).abs().max() < 0.2 * ref.abs().max()


def test_forward_bf16_weights(family):
    bb = tiny(family, dtype=torch.bfloat16)
    x, sigma, cond = _inputs(bb)  # float32 inputs to a bf16 model
    y = bb(x, sigma, cond)
    assert y.dtype == torch.float32 and torch.isfinite(y).all()


def test_output_depends_on_inputs(family):
    bb = tiny(family)
    x, sigma, cond = _inputs(bb)
    y = bb(x, sigma, cond)
    x2, sigma2, cond2 = _inputs(bb, seed=1)
    assert not torch.allclose(bb(x2, sigma, cond), y)
    assert not torch.allclose(bb(x, sigma2, cond), y)
    assert not torch.allclose(bb(x, sigma, Conditioning(cond2.text, cond.pooled)), y)
    if cond.pooled is not None:
        assert not torch.allclose(bb(x, sigma, Conditioning(cond.text, cond2.pooled)), y)
    # samples are independent: one sample's output does not depend on another's inputs
    x3 = x.clone()
    x3[1] = x2[1]
    torch.testing.assert_close(bb(x3, sigma, cond)[0], y[0])


def test_every_parameter_gets_gradient(family):
    bb = tiny(family)
    x, sigma, cond = _inputs(bb)
    bb(x, sigma, cond).sum().backward()
    # SD3's last block is context_pre_only: its text-token queries feed only the text stream, which
    # that block discards, so they get no gradient by construction (as in the published model).
    dead = set()
    if family == "sd3":
        last = f"model.transformer_blocks.{len(bb.model.transformer_blocks) - 1}.attn"
        dead = {f"{last}.add_q_proj.weight", f"{last}.add_q_proj.bias", f"{last}.norm_added_q.weight"}
    missing = [
        n for n, p in bb.named_parameters() if n not in dead and (p.grad is None or not torch.any(p.grad != 0))
    ]
    assert not missing, missing


def test_no_zero_parameters(family):
    zero = [n for n, p in tiny(family).named_parameters() if not torch.any(p != 0)]
    assert not zero, zero


def test_tiny_deterministic(family):
    a, b, c = tiny(family, seed=0), tiny(family, seed=0), tiny(family, seed=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    # the global RNG is left untouched
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    tiny(family, seed=5)
    assert torch.equal(torch.rand(3), before)


def test_tiny_overrides():
    bb = tiny("flux", height=16, width=12, text_len=5, num_layers=1)
    assert bb.latent_shape == (4, 16, 12) and bb.text_shape == (5, 32) and len(bb.model.transformer_blocks) == 1
    x, sigma, cond = _inputs(bb)
    assert bb(x, sigma, cond).shape == x.shape
    wan = tiny("wan", frames=3, height=4, width=6)
    assert wan.latent_shape == (4, 3, 4, 6)
    x, sigma, cond = _inputs(wan)
    assert wan(x, sigma, cond).shape == x.shape
    with pytest.raises(ValueError, match="not_a_key"):
        tiny("sd3", not_a_key=1)
    with pytest.raises(ValueError, match="frames"):
        tiny("sd3", frames=3)


def test_flux_packing_matches_pipeline():
    from diffusers import FluxPipeline

    bb = tiny("flux", height=8, width=12)
    x, sigma, cond = _inputs(bb)
    b, c, h, w = x.shape
    tokens = FluxPipeline._pack_latents(x, b, c, h, w)
    img_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, x.device, x.dtype)
    txt_ids = torch.zeros(cond.text.shape[1], 3)
    out = bb.model(
        hidden_states=tokens,
        encoder_hidden_states=cond.text,
        pooled_projections=cond.pooled,
        timestep=sigma,
        img_ids=img_ids,
        txt_ids=txt_ids,
        guidance=torch.full((b,), bb.guidance),
        return_dict=False,
    )[0]
    ref = FluxPipeline._unpack_latents(out, h * 8, w * 8, 8)
    torch.testing.assert_close(bb(x, sigma, cond), ref)


def test_sd3_and_wan_timestep_scale():
    for family in ("sd3", "wan"):
        bb = tiny(family)
        x, sigma, cond = _inputs(bb)
        kw = dict(hidden_states=x, encoder_hidden_states=cond.text, timestep=sigma * 1000, return_dict=False)
        if family == "sd3":
            kw["pooled_projections"] = cond.pooled
        torch.testing.assert_close(bb(x, sigma, cond), bb.model(**kw)[0])


def test_lora(family):
    bb = tiny(family)
    targets = bb.lora_target_modules()
    names = [n for n, _ in bb.model.named_modules()]
    for t in targets:
        assert any(n == t or n.endswith("." + t) for n in names), t
    x, sigma, cond = _inputs(bb)
    base = bb(x, sigma, cond)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        bb.model.add_adapter(
            LoraConfig(r=4, lora_alpha=4, target_modules=targets, init_lora_weights="gaussian")
        )
        lora_params = {n: p for n, p in bb.named_parameters() if "lora_" in n}
        assert lora_params
        # peft's "gaussian" init draws A but zeroes B (a no-op adapter); stand in for training.
        torch.testing.assert_close(bb(x, sigma, cond), base)
        with torch.no_grad():
            for n, p in lora_params.items():
                if "lora_B" in n:
                    p.normal_(0.0, 0.1)
    with_lora = bb(x, sigma, cond)
    assert not torch.allclose(with_lora, base)
    bb.model.disable_adapters()
    torch.testing.assert_close(bb(x, sigma, cond), base)
    bb.model.enable_adapters()
    torch.testing.assert_close(bb(x, sigma, cond), with_lora)


def _one_layer(family):
    # Tracing cost is per op; one block of each kind covers every code path.
    extra = {"num_single_layers": 1} if family == "flux" else {}
    return tiny(family, num_layers=1, **extra)


def _functional_forward(bb):
    # Buffers (SD3's positional table, Wan's rotary tables) are passed too: under fake-tensor
    # tracing every tensor the graph reads must be an input.
    state = {**dict(bb.named_parameters()), **dict(bb.named_buffers())}
    names = list(state)

    def f(tensors, x, sigma, text, pooled):
        cond = Conditioning(text, pooled)
        return torch.func.functional_call(bb, dict(zip(names, tensors)), (x, sigma, cond))

    return f, [t.detach() for t in state.values()]


@pytest.mark.parametrize("mode", ["fake", "real"])
def test_make_fx(family, mode):
    bb = _one_layer(family)
    x, sigma, cond = _inputs(bb)
    f, params = _functional_forward(bb)
    gm = make_fx(f, tracing_mode=mode)(params, x, sigma, cond.text, cond.pooled)
    assert len(gm.graph.nodes) > 30
    if mode == "real":
        torch.testing.assert_close(gm(params, x, sigma, cond.text, cond.pooled), bb(x, sigma, cond))


def test_aot_module(family):
    from functorch.compile import aot_module, make_boxed_func

    bb = _one_layer(family)
    x, sigma, cond = _inputs(bb)
    graphs = []

    def compiler(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    compiled = aot_module(bb, fw_compiler=compiler, bw_compiler=compiler)
    x.requires_grad_(True)
    y = compiled(x, sigma, cond)
    torch.testing.assert_close(y, bb(x, sigma, cond))
    y.sum().backward()
    assert x.grad is not None and len(graphs) == 2


def test_dummy_conditioning(family):
    bb = tiny(family)
    a = bb.dummy_conditioning(3, torch.Generator().manual_seed(7))
    b = bb.dummy_conditioning(3, torch.Generator().manual_seed(7), dtype=torch.float64)
    assert a.text.shape == (3, 8, 32) and b.text.dtype == torch.float64
    assert (a.pooled is None) == (family == "wan")
    torch.testing.assert_close(a.text.double(), b.text)


# ---------------------------------------------------------------------------------------------
# Real configs


@pytest.mark.parametrize(
    "name,lo,hi",
    [
        ("flux.1-dev", 11.8e9, 12.0e9),
        ("sd3.5-medium", 2.2e9, 2.5e9),
        ("wan2.1-1.3b", 1.3e9, 1.5e9),
        ("wan2.1-14b", 13.5e9, 14.5e9),
    ],
)
def test_real_builds_on_meta(name, lo, hi):
    # how long building takes is measured by `make bench` (benchmarks/build_time.py)
    bb = real(name)
    n = sum(p.numel() for p in bb.parameters())
    assert lo < n < hi
    p = next(bb.parameters())
    assert p.device.type == "meta" and p.dtype == torch.bfloat16
    spec = load_config(name)
    assert "/" in spec["source"] and spec["family"] == bb.family
    assert bb.text_shape == (spec["geometry"]["text_len"], spec["geometry"]["text_dim"])
    names = [m for m, _ in bb.model.named_modules()]
    for t in bb.lora_target_modules():
        assert any(m == t or m.endswith("." + t) for m in names), t


def test_real_geometry():
    flux = real("flux.1-dev", resolution=(512, 768))
    assert flux.latent_shape == (16, 64, 96) and flux.text_shape == (512, 4096) and flux.pooled_dim == 768
    assert real("sd3.5-medium").text_shape == (333, 4096) and real("sd3.5-medium").pooled_dim == 2048
    wan = real("wan2.1-1.3b", resolution=(480, 832), frames=81)
    assert wan.latent_shape == (16, 21, 60, 104) and wan.text_shape == (512, 4096) and wan.pooled_dim is None
    with pytest.raises(ValueError, match="resolution"):
        real("flux.1-dev", resolution=1000)


@pytest.mark.parametrize(
    "name,kwargs,shape",
    [
        ("flux.1-dev", dict(resolution=1024), (1, 16, 128, 128)),
        ("sd3.5-medium", dict(resolution=512), (1, 16, 64, 64)),
        ("wan2.1-1.3b", dict(resolution=(256, 256), frames=9), (1, 16, 3, 32, 32)),
    ],
)
def test_real_forward_on_meta(name, kwargs, shape):
    bb = real(name, **kwargs)
    x = torch.empty((1, *bb.latent_shape), device="meta", dtype=torch.bfloat16)
    sigma = torch.empty(1, device="meta", dtype=torch.bfloat16)
    cond = bb.dummy_conditioning(1)
    assert cond.text.device.type == "meta"
    with torch.no_grad():
        y = bb(x, sigma, cond)
    assert y.shape == shape and y.device.type == "meta" and y.dtype == torch.bfloat16


def test_build_generic():
    cfg = {"_class_name": "SD3Transformer2DModel", "sample_size": 8, "patch_size": 2, "in_channels": 4,
           "num_layers": 1, "attention_head_dim": 8, "num_attention_heads": 2, "joint_attention_dim": 16,
           "caption_projection_dim": 16, "pooled_projection_dim": 8, "out_channels": 4,
           "pos_embed_max_size": 8}
    bb = build("sd3", cfg, (4, 8, 8), (3, 16), 8, dtype=torch.float64)
    x, sigma, cond = _inputs(bb, dtype=torch.float64)
    assert bb(x, sigma, cond).shape == x.shape
    with pytest.raises(ValueError, match="latent_shape"):
        build("sd3", cfg, (16, 8, 8), (3, 16), 8)
    with pytest.raises(ValueError, match="config"):
        build("sd3", {**cfg, "bogus": 1}, (4, 8, 8), (3, 16), 8)


# ---------------------------------------------------------------------------------------------
# Errors


def test_unknown_names():
    with pytest.raises(ValueError, match="family.*flux.*sd3.*wan"):
        tiny("unet")
    with pytest.raises(ValueError, match="family"):
        build("unet", {}, (4, 8, 8), (8, 32), 16)
    with pytest.raises(ValueError, match="name.*flux.1-dev.*wan2.1-14b"):
        real("flux.1-schnell")


def test_forward_validation(family):
    bb = tiny(family)
    x, sigma, cond = _inputs(bb)
    with pytest.raises(ValueError, match=r"x: expected .* got"):
        bb(x[..., :4], sigma, cond)
    with pytest.raises(ValueError, match=r"x: expected"):
        bb(x[0], sigma, cond)
    with pytest.raises(ValueError, match=r"sigma: expected shape \(2,\).* got \(3,\)"):
        bb(x, torch.rand(3), cond)
    with pytest.raises(ValueError, match=r"sigma"):
        bb(x, torch.rand(()), cond)
    with pytest.raises(ValueError, match=r"cond: expected batch size 2.* got 1"):
        bb(x, sigma, cond.index(slice(0, 1)))
    with pytest.raises(ValueError, match=r"cond.text"):
        bb(x, sigma, Conditioning(cond.text[:, :3], cond.pooled))
    if family != "wan":
        with pytest.raises(ValueError, match=r"cond.pooled"):
            bb(x, sigma, Conditioning(cond.text, None))
