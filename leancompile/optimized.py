"""The optimized trainer: the user's trainer class with the protocol's call sites routed through a runtime.

:func:`leancompile.optimize` returns a shallow copy of the trainer whose class is ``Optimized<Name>``, this mixin
placed before the trainer's own class. Each override calls the trainer's own method and lets the runtime
(:class:`~leancompile.runtime.retain.RetainRuntime` or :class:`~leancompile.runtime.reweight.ReweightRuntime`)
answer the backbone calls it rewrote; with no runtime (the native plan) every method is the trainer's.
"""
from __future__ import annotations

from .plan import Plan
from .runtime.base import Runtime, running, swapped_backbone


class Optimized:
    """Mixed in before the trainer's own class."""

    plan: Plan
    graphs: dict
    _runtime: Runtime | None
    _sync_deferred = False  # a backward that should have synced the gradients left it to the runtime

    def explain(self) -> str:
        from .explain import explain_text

        return explain_text(self)

    def step(self, prompts):
        runtime = self._runtime
        if runtime is None:
            return super().step(prompts)
        runtime.begin_step()
        try:
            with self.sync.whole_weights(self) as (backbone, _), running(self, backbone):
                stats = super().step(prompts)
        finally:
            records, extra = runtime.state.records, runtime.end_step()
        stats.update(extra)
        self.last_micro_steps = list(records)
        self.graphs.update(runtime_graphs(runtime))
        return stats

    def sde_mask(self):
        mask = super().sde_mask()
        if self._runtime is not None:
            # Epoch 0's trained steps come from the ``steps`` generator right after the window, exactly where the
            # native update would draw them; rewards cannot change them, so they are known before the rollout.
            self._runtime.state.schedule = super().trained_step_schedule(self._num_samples, mask)
        return mask

    def rollout(self, prompts):
        prompts = list(prompts)
        self._num_samples = len(prompts) * getattr(self, "samples_per_prompt", self.config.group_size)
        if self._runtime is not None:
            self._runtime.begin_rollout(self, prompts)
        return super().rollout(prompts)

    def trained_step_schedule(self, num_samples, sde_steps):
        runtime = self._runtime
        if runtime is not None and runtime.state.schedule is not None:  # epoch 0: the draw made before the rollout
            schedule, runtime.state.schedule = runtime.state.schedule, None
            return schedule
        if runtime is not None:
            runtime.next_epoch()
        return super().trained_step_schedule(num_samples, sde_steps)

    def rollout_velocity(self, step, rows, x, sigma, cond):
        call = self._runtime.rollout_call(step, rows) if self._runtime is not None else None
        if call is None:
            return super().rollout_velocity(step, rows, x, sigma, cond)
        with swapped_backbone(self, call):
            return super().rollout_velocity(step, rows, x, sigma, cond)

    def rollout_step(self, step, rows, x, cond, sde):
        x_next, log_prob = super().rollout_step(step, rows, x, cond, sde)
        if self._runtime is not None:
            self._runtime.after_rollout_step(step, rows, x, x_next, log_prob, cond, super().micro_step_loss)
        return x_next, log_prob

    def update(self, rollout, advantages):
        if self._runtime is not None:
            self._runtime.begin_update(rollout, advantages)
        return super().update(rollout, advantages)

    def micro_step(self, rollout, advantages, rows, steps):
        if self._runtime is not None:
            self._runtime.track_micro_step(rows)
        return super().micro_step(rollout, advantages, rows, steps)

    def micro_step_loss(self, micro):
        if self._runtime is None:
            return super().micro_step_loss(micro)
        return self._runtime.micro_step_loss(micro, super().micro_step_loss)

    def train_velocity(self, micro):
        call = self._runtime.train_call(micro) if self._runtime is not None else None
        if call is None:
            return super().train_velocity(micro)
        with swapped_backbone(self, call):
            return super().train_velocity(micro)

    def reference_velocity(self, micro):
        if self._runtime is None:
            return super().reference_velocity(micro)
        return self._runtime.reference_velocity(micro, super().reference_velocity)

    def backward(self, loss, sync=True):
        runtime = self._runtime
        if runtime is None:
            return super().backward(loss, sync)
        # While the rollout's work is pending, the gradient sync waits for the runtime's own backward.
        defer = runtime.window_refusal() is None
        self._sync_deferred = self._sync_deferred or (defer and sync)
        super().backward(loss, sync and not defer)
        runtime.after_backward()

    def optimizer_step(self):
        if self._runtime is not None:
            deferred, self._sync_deferred = self._sync_deferred, False
            if not self._runtime.before_optimizer_step(self.sync.backward(deferred)) and deferred:
                self.sync.flush(self.trainable)
        super().optimizer_step()
        self.sync.weights_changed()


def runtime_graphs(runtime) -> dict:
    """The graphs a runtime compiled while running: the partitioned backbone, the correction."""
    graphs = {}
    partitioned = getattr(runtime, "partitioned", None)
    if partitioned is not None and partitioned.forward_graph is not None:
        graphs["backbone_forward"] = partitioned.forward_graph
        graphs["backbone_backward"] = partitioned.backward_graph
    correction = getattr(runtime, "correction", None)
    if correction is not None and correction.graph is not None:
        graphs["correction"] = correction.graph
    return graphs


_CLASSES: dict[type, type] = {}


def optimized_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Optimized{cls.__name__}", (Optimized, cls), {})
    return _CLASSES[cls]
