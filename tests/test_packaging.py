"""What ``pip install leancompile`` gives an existing environment: the core imports and wraps without the extras."""
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = ("diffusers", "peft", "transformers", "sklearn", "matplotlib", "PIL", "tqdm", "trl", "accelerate")

# Makes the optional packages unfindable, as in an environment that has only torch and the core dependencies
# (importlib.util.find_spec answers None for them, as torch's own probes expect).
BLOCKER = textwrap.dedent(f"""
    import sys
    from importlib.machinery import PathFinder
    class WithoutExtras(PathFinder):
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name.split(".")[0] in {OPTIONAL!r}:
                return None
            return PathFinder.find_spec(name, path, target)
    sys.meta_path = [WithoutExtras if finder is PathFinder else finder for finder in sys.meta_path]
""")


def _run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_import_loads_no_optional_package():
    # torch itself imports tqdm where it is installed (torch.hub)
    loaded = tuple(m for m in OPTIONAL if m != "tqdm") + ("torch._dynamo",)
    out = _run(f"import sys, leancompile\nprint(sorted(m for m in {loaded!r} if m in sys.modules))")
    assert out.strip() == "[]"


def test_core_wraps_a_plain_module_without_the_extras():
    out = _run(BLOCKER + textwrap.dedent("""
        import torch, leancompile
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()
        x = torch.randn(3, 4, dtype=torch.float64)
        wrapped = leancompile.wrap(model)
        with torch.no_grad():
            wrapped(x)                       # the rollout's call: kept
        wrapped(x).square().sum().backward()  # the update's call: served from it
        served = [p.grad.clone() for p in model.parameters()]
        print(wrapped.stats()["served_calls"])
        leancompile.unwrap(wrapped)           # the module is the wrapped one: its native call again
        model.zero_grad()
        model(x).square().sum().backward()
        assert all(torch.allclose(a, p.grad, rtol=1e-10, atol=0) for a, p in zip(served, model.parameters()))
    """))
    assert out.strip() == "1"


def test_a_backbone_without_diffusers_says_what_to_install():
    out = _run(BLOCKER + textwrap.dedent("""
        from leancompile import backbones
        try:
            backbones.tiny("sd3")
        except ImportError as error:
            print(error)
    """))
    assert "pip install 'leancompile[diffusers]'" in out


def test_core_dependencies_are_ranges_and_the_extras_hold_the_rest():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_name(r): r for r in project["dependencies"]}
    assert set(core) == {"torch", "networkx", "sympy", "safetensors", "numpy", "xxhash"}
    assert all("==" not in r for r in core.values())
    extras = project["optional-dependencies"]
    diffusers = {_name(r): r for r in extras["diffusers"]}
    assert "==" not in diffusers["diffusers"] and "<" in diffusers["diffusers"]  # a tested range
    assert {"demo", "test", "trl", "accelerate", "diffusers"} <= set(extras)


def _name(requirement: str) -> str:
    return requirement.split(";")[0].split("[")[0].split("=")[0].split("<")[0].split(">")[0].split("~")[0].strip()
