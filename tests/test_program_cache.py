"""The program cache on disk (leancompile.runtime.program_cache): a later process (here: a fresh wrapper with the
in-process traces dropped, as a new process starts) reads the partition and traces a first one compiled, and its
gradients are bit for bit those compiled here; whatever changes what the module computes is another entry; an entry
that does not read back is compiled again; the cache off writes nothing."""
import pytest
import torch

import leancompile
from leancompile import backbones
from leancompile.runtime import program_cache, rowwise


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANCOMPILE_CACHE", "1")
    monkeypatch.setenv("LEANCOMPILE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(rowwise, "_TRACES", type(rowwise._TRACES)())
    return tmp_path


def _sd3(**overrides):
    backbone = backbones.tiny("sd3", seed=0, dtype=torch.float64, **overrides)
    text = backbone.dummy_conditioning(3, torch.Generator().manual_seed(1), dtype=torch.float64)
    latents = torch.randn(3, *backbone.latent_shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    inputs = dict(hidden_states=latents, timestep=torch.tensor([500.0, 300.0, 100.0], dtype=torch.float64),
                  encoder_hidden_states=text.text, pooled_projections=text.pooled)
    return backbone.model, inputs


def _served_step(module, inputs) -> tuple[torch.Tensor, dict, list]:
    """A rollout call and its update served: the gradients, the stats and the passes the wrapper records."""
    rowwise._TRACES.clear()  # what a new process has in memory: nothing
    wrapped = leancompile.wrap(module)
    with torch.no_grad():
        wrapped(**inputs, return_dict=False)
    module.zero_grad(set_to_none=True)
    wrapped(**inputs, return_dict=False)[0].square().sum().backward()
    stats = wrapped.stats()
    assert stats["served_calls"] == 1, wrapped.last_calls
    history = [(r.name, r.graph, r.changed, r.nodes) for r in wrapped.__dict__["_leancompile_runtime"].engine
               .rowwise[1.0].history.records]
    leancompile.unwrap(wrapped)
    return torch.cat([p.grad.flatten() for p in module.parameters() if p.grad is not None]), stats, history


def test_a_later_process_reads_the_programs_and_computes_the_same_bits(cache):
    module, inputs = _sd3()
    compiled, first, passes = _served_step(module, inputs)
    entries = sorted(p.name for p in cache.iterdir())
    assert [e.split("-")[0] for e in entries] == ["partition", "rows", "rows"], entries  # forward and backward
    read, second, passes_read = _served_step(module, inputs)
    assert sorted(p.name for p in cache.iterdir()) == entries  # nothing compiled, nothing written
    assert torch.equal(read, compiled)
    assert passes_read == passes  # the passes that made them, as recorded when they ran
    assert second["compile_seconds"] < first["compile_seconds"]


def test_what_changes_the_computation_is_another_entry(cache):
    module, inputs = _sd3()
    _served_step(module, inputs)
    entries = set(cache.iterdir())
    module.transformer_blocks[0].norm1.norm.eps = 1e-3  # a constant of the graph, not a weight
    changed, _, _ = _served_step(module, inputs)
    assert len(set(cache.iterdir()) - entries) == 3  # a new partition, and traces of it
    with pytest.MonkeyPatch.context() as off:
        off.setenv("LEANCOMPILE_CACHE", "0")
        assert torch.equal(changed, _served_step(module, inputs)[0])


def test_an_entry_that_does_not_read_back_is_compiled_again(cache):
    module, inputs = _sd3()
    compiled, _, _ = _served_step(module, inputs)
    for entry in cache.iterdir():
        entry.write_bytes(entry.read_bytes()[:100])  # torn
    again, _, _ = _served_step(module, inputs)
    assert torch.equal(again, compiled)
    assert all(entry.stat().st_size > 100 for entry in cache.iterdir())  # rewritten whole


def test_graphs_rebuild_node_for_node(cache):
    """What the cache stores of a graph is its nodes by name: rebuilt, the code and constants are the same."""
    module, inputs = _sd3()
    _served_step(module, inputs)
    for program in [*rowwise._TRACES.values()]:
        rebuilt = program_cache.rebuild(program_cache.dump(program))
        assert rebuilt.code == program.code


def test_a_graph_calling_a_function_without_an_importable_name_is_not_stored():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(lambda t: t + 1, (x,)))
    with pytest.raises(program_cache.Unstorable, match="no importable name"):
        program_cache.dump(torch.fx.GraphModule(torch.nn.Module(), graph))


def test_the_cache_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANCOMPILE_CACHE", "0")
    monkeypatch.setenv("LEANCOMPILE_CACHE_DIR", str(tmp_path))
    _served_step(*_sd3())
    assert not list(tmp_path.iterdir())
