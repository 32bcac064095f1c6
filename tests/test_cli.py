"""The command line: its flags, ``--version``, ``env``, and ``plan --config`` for a model of one's own."""
import json
import subprocess
import sys

import pytest

import leancompile
from leancompile.backbones import factory
from leancompile.cli import build_parser, main as cli



def _flags(parser) -> dict[str, set[str]]:
    """Each subcommand's option strings."""
    sub = next(a for a in parser._actions if a.dest == "command")
    return {name: {s for a in p._actions for s in a.option_strings} for name, p in sub.choices.items()}


@pytest.mark.fast
def test_flags_mean_one_thing_across_commands():
    flags = _flags(build_parser())
    assert {"env", "demo", "plan", "tiny-report"} <= set(flags)
    everywhere = set().union(*flags.values())
    assert "--steps" not in everywhere and "--cfg" not in everywhere  # ambiguous between commands
    assert "--grpo-steps" in flags["demo"] and "--denoising-steps" in flags["plan"]
    assert "--guidance-scale" in flags["plan"] and "--guidance-scale" in flags["tiny-report"]
    assert {"--model", "--config", "--device"} <= flags["plan"]


@pytest.mark.fast
def test_every_option_says_what_it_means():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name, parser in sub.choices.items():
        for action in parser._actions:
            if action.option_strings and action.dest != "help":
                assert action.help and len(action.help) > 10, (name, action.option_strings)


@pytest.mark.fast
def test_version_and_env(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"leancompile {leancompile.__version__}"
    assert cli(["env"]) == 0
    out = capsys.readouterr().out
    for name in ("torch", "diffusers", "peft", "trl", "accelerate", "devices:", "supported:", "FSDP2"):
        assert name in out


@pytest.mark.fast
def test_help_loads_no_optional_package():
    code = ("import sys; from leancompile.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = {'diffusers', 'peft', 'transformers', 'sklearn', 'matplotlib', 'torch._dynamo'}\n"
            "print(sorted(heavy & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


# Profiles a real-size model on fake tensors (tens of seconds): not in the fast tier.
def test_plan_reads_a_diffusers_config_as_the_shipped_model(tmp_path, capsys):
    record = factory.load_config("wan2.1-1.3b")
    path = tmp_path / "config.json"  # as diffusers' save_pretrained writes it
    path.write_text(json.dumps({"_class_name": record["class"], "_diffusers_version": "0.42.1", **record["config"]}))
    settings = ["--device", "rtx-4090", "--resolution", "256", "--frames", "9", "--samples", "4", "--json"]
    assert cli(["plan", "--model", "wan2.1-1.3b", *settings]) == 0
    shipped = json.loads(capsys.readouterr().out)
    assert cli(["plan", "--config", str(tmp_path), *settings]) == 0
    own = json.loads(capsys.readouterr().out)
    assert own["schedules"] == shipped["schedules"] and own["model"] == str(tmp_path)
    path.write_text(json.dumps({"_class_name": "UNet2DConditionModel", "in_channels": 4}))
    assert cli(["plan", "--config", str(path)]) == 2
    assert "UNet2DConditionModel" in capsys.readouterr().err

