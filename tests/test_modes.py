"""A rollout in ``eval()`` and an update in ``train()`` (UniRL, FlowGRPO's and DanceGRPO's scripts): served wherever
the two modes compute the same, per block too, where the module's forward traced in both modes is one graph and so
is each block's one-row program; where a submodule reads its flag to effect (dropout with p > 0), the calls
recompute, exact, and the reason names that submodule."""
import copy
import os

import torch
import torch.distributed as dist

import leancompile
from leancompile import backbones
from leancompile.runtime.identity import CallState, StateReader
from leancompile.runtime.regional import RegionalEngine, transformer_blocks
from conftest import spawn_ranks

WORLD = 2
STEPS = 2  # rollout calls, each trained by the update in two micro-batches of two rows


def _model(dropout: bool = False) -> torch.nn.Module:
    """A tiny SD3 transformer in float64; with ``dropout``, a Dropout(p=0.1) after its context embedder, which runs
    in its forward outside the blocks."""
    model = backbones.tiny("sd3", dtype=torch.float64).model
    if dropout:
        model.context_embedder = torch.nn.Sequential(model.context_embedder, torch.nn.Dropout(p=0.1))
    return model


def _inputs(model: torch.nn.Module, step: int, rows: int = 4) -> dict:
    config = model.config
    generator = torch.Generator().manual_seed(step)
    draw = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64)  # noqa: E731
    size = config.sample_size
    return dict(hidden_states=draw(rows, config.in_channels, size, size), timestep=torch.full((rows,), 0.9 - step / 4,
                dtype=torch.float64), encoder_hidden_states=draw(rows, 5, config.joint_attention_dim),
                pooled_projections=draw(rows, config.pooled_projection_dim), return_dict=False)


def _eval_then_train(model: torch.nn.Module, parameters) -> list[torch.Tensor]:
    """Samples in ``eval()`` without grad, then trains in ``train()`` on the same rows (each call's dropout draws
    seeded alike whatever runs it); returns the accumulated gradient of ``parameters`` (a sharded one's local
    shard)."""
    calls = [_inputs(model, step) for step in range(STEPS)]
    model.eval()
    with torch.no_grad():
        for call in calls:
            model(**call)
    model.train()
    for step, call in enumerate(calls):
        for half in (slice(0, 2), slice(2, 4)):
            torch.manual_seed(10 * step + half.start)
            rows = {k: v[half] if torch.is_tensor(v) else v for k, v in call.items()}
            weight = torch.linspace(-1, 1, rows["hidden_states"][0].numel(), dtype=torch.float64)
            (model(**rows)[0].flatten(1) * weight).sum().backward()
    local = lambda g: g.to_local() if hasattr(g, "to_local") else g  # noqa: E731
    return [local(p.grad).clone() for p in parameters]


def _relative(wrapped: list[torch.Tensor], native: list[torch.Tensor]) -> float:
    a, b = torch.cat([g.flatten() for g in wrapped]), torch.cat([g.flatten() for g in native])
    assert b.norm() > 0
    return float((a - b).norm() / b.norm())


def test_sampled_in_eval_and_trained_in_train_every_block_call_is_served():
    native = _model()
    wrapped = leancompile.wrap(copy.deepcopy(native), per_block=True)
    assert isinstance(wrapped.engine, RegionalEngine)
    grads = _eval_then_train(wrapped, list(wrapped.parameters()))
    assert _relative(grads, _eval_then_train(native, list(native.parameters()))) <= 1e-10
    stats = wrapped.stats()
    # Four update calls, each with every block served
    assert stats["served_calls"] == 2 * STEPS * len(transformer_blocks(wrapped)), stats
    assert stats["recomputed_calls"] == 0, stats
    # Each block's engine met its own flags' difference and found its one-row programs in both modes equal
    assert all(engine._same and all(engine._same.values()) for engine in wrapped.engine.engines)


def test_with_dropout_outside_the_blocks_the_update_recomputes_and_says_where():
    native = _model(dropout=True)
    wrapped = leancompile.wrap(copy.deepcopy(native), per_block=True)
    grads = _eval_then_train(wrapped, list(wrapped.parameters()))
    assert _relative(grads, _eval_then_train(native, list(native.parameters()))) <= 1e-10
    reasons = {r.reason for r in wrapped.last_calls if r.action == "recomputed"}  # until stats() is read
    stats = wrapped.stats()
    assert stats["served_calls"] == 0 and stats["recompute_reasons"] == {"training flags": stats["recomputed_calls"]}
    assert len(reasons) == 1 and "submodule context_embedder.1 " in reasons.pop(), reasons


def test_the_two_modes_are_one_graph_only_where_no_submodule_reads_its_flag_to_effect():
    """The module's forward in both modes, compared as traced: dropout with p = 0 and layer norm leave one graph;
    dropout with p > 0 and batch norm (the batch's statistics in train mode) make two."""
    def differs(extra: torch.nn.Module) -> str | None:
        model = _model()
        model.context_embedder = torch.nn.Sequential(model.context_embedder, extra)
        engine = leancompile.wrap(model, per_block=True).engine
        call = leancompile.runtime.calls.Call.of((), _inputs(model, 0), engine.call_shared)
        model.eval()
        kept = engine.reader.read(call)
        model.train()
        return engine._modes(kept, engine.reader.read(call), call)

    class Transposed(torch.nn.Module):  # batch norm over the features of (rows, tokens, features)
        def __init__(self, width):
            super().__init__()
            self.norm = torch.nn.BatchNorm1d(width, dtype=torch.float64)

        def forward(self, x):
            return self.norm(x.transpose(1, 2)).transpose(1, 2)

    width = _model().config.caption_projection_dim
    assert differs(torch.nn.Dropout(p=0.0)) is None
    assert differs(torch.nn.LayerNorm(width, dtype=torch.float64)) is None
    assert "submodule context_embedder.1 " in differs(torch.nn.Dropout(p=0.1))
    assert "submodule context_embedder.1.norm " in differs(Transposed(width))


def test_a_training_flag_difference_is_explained_by_the_submodule_that_reads_its_flag():
    """Of the submodules whose flags differ, the one named is one whose mode changes what it computes."""
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(p=0.0), torch.nn.Dropout(p=0.5))
    reader = StateReader(module)
    call = leancompile.runtime.calls.Call.of((torch.zeros(1, 2),), {}, frozenset())
    module.eval()
    kept = reader.read(call)
    module.train()
    now = reader.read(call)
    assert isinstance(kept, CallState) and kept.difference(now) == "training flags"
    assert kept.explain(now, reader).startswith("submodule 2 (Dropout) is in train mode")


def _fsdp_worker(rank, port, out):
    """FSDP2 alone and wrapped (per block: a submodule is sharded), without and with dropout outside the blocks:
    each rank's local gradient shards and the wrapped module's statistics."""
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    results = {}
    for dropout in (False, True):
        for use in (False, True):
            model = _model(dropout)
            for block in transformer_blocks(model):
                fully_shard(block)
            fully_shard(model)
            if use:
                model = leancompile.wrap(model)
            grads = _eval_then_train(model, list(model.parameters()))
            results[dropout, use] = (grads, model.stats() if use else {},
                                     isinstance(model.engine, RegionalEngine) if use else False)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_under_fsdp2_sampled_in_eval_and_trained_in_train_serves_every_block_call_and_with_dropout_recomputes(
        tmp_path):
    """The acceptance loop under FSDP2 on two gloo ranks, each rank's gradient shards against FSDP2 alone's (one
    test: the ranks run once whatever the test workers)."""
    blocks = len(transformer_blocks(_model()))
    for rank in spawn_ranks(_fsdp_worker, WORLD, tmp_path):
        native, (wrapped, stats, per_block) = rank[False, False][0], rank[False, True]
        assert per_block
        assert _relative(wrapped, native) <= 1e-10
        assert stats["served_calls"] == 2 * STEPS * blocks and stats["recomputed_calls"] == 0, stats
        native, (wrapped, stats, per_block) = rank[True, False][0], rank[True, True]  # with dropout
        assert per_block
        assert _relative(wrapped, native) <= 1e-10
        assert stats["served_calls"] == 0 and stats["recomputed_calls"] > 0, stats
        assert set(stats["recompute_reasons"]) == {"training flags"}, stats
