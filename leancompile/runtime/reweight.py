"""Reweight at run time: the rollout backpropagates each trained step as soon as it is sampled, with a provisional
advantage, into per-sample gradient buffers; once the advantages are known, the correction scales and sums the
buffers into the weights' gradients, and the update skips those micro-steps.

At ratio 1 the loss of one row is affine in its advantage (the linearity pass proves it):
``loss_i(A) = A * P_i + F_i``, ``F_i`` the advantage-free terms (e.g. the KL penalty). After each trained step the
rollout evaluates the trainer's own loss head on the step's output (a leaf: no second backbone forward) for the
rows that train it, at ``A = 1`` (and at ``A = 0`` when there are advantage-free terms), which gives the
cotangents of ``P_i`` and ``F_i`` on the backbone's output; one backward of the batched call (two with
advantage-free terms) gives every sample's ``dP_i`` and ``dF_i`` (:mod:`leancompile.runtime.per_sample`), summed
over the sample's trained steps into its buffers. The call's output values are kept (a latent per row and step),
and so is a KL reference's velocity: the reference runs once per (sample, step), as in the native update.

A micro-step of the update before the first optimizer step whose rows all have buffers runs only its loss head,
without grad, on the kept outputs (its loss and statistics are the native ones); the weight ``w`` the trainer's
backward gives the loss (``1 / (accumulation x trained steps)``) is read off that backward. The correction then
adds ``sum_i w_i (A_i dP_i + dF_i)``, ``w_i = w / |micro-batch|``, to the gradients before that optimizer step.

With moment accumulators (:mod:`leancompile.passes.moments`) a finished sample is scored at once and its buffers
fold into per-group sums ``sum (r_i - r0) dP_i``, ``sum dP_i`` and ``sum dF_i`` (``r0``: the group's first reward,
so the sums do not cancel); the correction applies each group's mean and std.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..trainers.advantages import group_statistics
from .base import Runtime, StepState
from .correction import Correction
from .per_sample import PerSampleGradients


@dataclass
class ProvisionalCall:
    """The rollout's backbone call for one (chunk, step), run with grad."""

    step: int
    rows: torch.Tensor
    inputs: torch.Tensor
    output: torch.Tensor  # with its autograd graph
    leaf_rows: torch.Tensor | None = None  # the call rows the current head evaluation reads
    leaf: torch.Tensor | None = None


@dataclass
class GroupMoments:
    offset: float  # r0, the group's first finished reward
    centred: list[torch.Tensor]  # sum_i (r_i - r0) dP_i
    plain: list[torch.Tensor]  # sum_i dP_i
    free: list[torch.Tensor] | None  # sum_i dF_i


@dataclass
class ReweightState(StepState):
    mode: str = "per-sample"  # "per-sample" | "accumulators"
    mode_reason: str = ""
    prompts: list = field(default_factory=list)
    window: set = field(default_factory=set)  # samples whose trained steps the rollout backpropagates
    slots: dict = field(default_factory=dict)  # window sample -> its row of the per-sample buffers
    rows: dict = field(default_factory=dict)  # "policy" | "free" -> per parameter, (window samples, *shape) buffers
    call: ProvisionalCall | None = None
    kept: dict = field(default_factory=dict)  # (sample, step) -> (backbone inputs, outputs) of the sample's rows
    reference: dict = field(default_factory=dict)  # (sample, step) -> (input latent, KL reference's velocity)
    policy: dict = field(default_factory=dict)  # sample -> [dP_i per parameter] (per-sample mode: views of rows)
    free: dict = field(default_factory=dict)  # sample -> [dF_i per parameter]
    groups: dict = field(default_factory=dict)  # group -> GroupMoments
    early_rewards: dict = field(default_factory=dict)  # sample -> reward scored as soon as it finished
    advantages: torch.Tensor | None = None
    usable: bool = False
    unusable_reason: str = "the rollout backpropagated nothing"
    weights: dict = field(default_factory=dict)  # sample -> [w / |micro-batch| of each skipped micro-step]
    buffer_bytes: int = 0
    kept_bytes: int = 0  # kept backbone inputs, outputs and reference velocities, read by the update's heads
    peak_buffer_bytes: int = 0
    peak_buffers: int = 0


class _LossWeight(torch.autograd.Function):
    """Passes a loss value through; its backward reports the weight the trainer gave the loss."""

    @staticmethod
    def forward(ctx, value, anchor, sink):
        ctx.sink = sink
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.sink.append(float(grad))
        return None, None, None


class ReweightRuntime(Runtime):
    """Executes a Reweight plan for one trainer. ``accumulate(num_samples) -> (bool, reason)`` says when moment
    accumulators are exact (from the passes); ``segments`` is the shared call's row layout."""

    action = "reweight"
    state_class = ReweightState

    def __init__(self, trainer, segments: int, accumulate, advantage_free: bool, tune_matmuls: bool = True):
        super().__init__(trainer.trainable)
        self.config = trainer.config
        self.reward_fn = trainer.reward_fn
        self.generator = trainer.generators["shuffle"]
        self.sigmas = trainer.sigmas
        self.segments = segments
        self.accumulate = accumulate
        self.advantage_free = advantage_free  # the loss has advantage-free terms: a second cotangent
        self._serving = None  # the update micro-step whose loss head reads the kept outputs
        self._keeping_reference = False  # the rollout's loss heads are running: keep the reference velocities
        self.per_sample = PerSampleGradients(trainer.backbone, trainer.trainable, tune_matmuls)
        self.correction = Correction(trainer.trainable)
        self._buffer_size = sum(p.numel() * p.element_size() for p in trainer.trainable)

    def end_step(self) -> dict:
        s = self.state
        stats = {**super().end_step(), "buffer_bytes": s.peak_buffer_bytes, "buffers": s.peak_buffers,
                 "buffer_mode": s.mode, "buffer_reason": s.mode_reason, "kept_output_bytes": s.kept_bytes}
        self.state = self.state_class()  # nothing outlives its GRPO step
        return stats

    # ------------------------------------------------------------------------------------------ rollout

    def begin_rollout(self, trainer, prompts: list) -> None:
        cfg, s = self.config, self.state
        s.prompts = [p for p in prompts for _ in range(getattr(trainer, "samples_per_prompt", cfg.group_size))]
        n = len(s.prompts)
        # The first optimizer step's micro-batches, as micro_batches() will draw them if no sample is dropped;
        # a sample dropped or moved after all just recomputes.
        shuffle = torch.Generator().set_state(self.generator.get_state())
        s.window = set(torch.randperm(n, generator=shuffle)[:cfg.gradient_accumulation_steps * cfg.train_batch_size]
                       .tolist())
        s.slots = {sample: row for row, sample in enumerate(sorted(s.window))}
        accumulate, reason, _ = self.accumulate(n)
        s.mode, s.mode_reason = ("accumulators" if accumulate else "per-sample"), reason

    def rollout_call(self, step: int, rows: torch.Tensor):
        s = self.state
        if not any(r in s.window for r in rows.cpu()[self.trained_at(step, rows)].tolist()):
            return None

        def call(x, sigma, cond):
            self.remember_weights()
            with torch.enable_grad():
                output = self.per_sample.forward(x, sigma, cond, len(rows))
            s.call = ProvisionalCall(step, rows.cpu(), x.detach(), output)
            return output.detach()

        return call

    def train_call(self, micro):
        call = self.state.call
        if self._serving is micro:
            return self._kept_call(micro)
        if call is None or call.leaf_rows is None:
            return None

        def leaf(x, sigma, cond):
            if not torch.equal(x, call.inputs[call.leaf_rows]):
                raise RuntimeError("leancompile: the loss head's backbone input differs from the rollout's call; "
                                   "the trainer's train_velocity does not recompute rollout_velocity")
            if call.leaf is None:
                call.leaf = call.output.detach()[call.leaf_rows].requires_grad_()
            return call.leaf

        return leaf

    def _kept_call(self, micro):
        """The backbone's answer for ``micro``'s rows, from the values the rollout kept."""
        kept = [self.state.kept[(r, t)] for r, t in zip(micro.rows.tolist(), micro.steps.tolist())]

        def call(x, sigma, cond):
            inputs = torch.cat([torch.stack([k[0][s] for k in kept]) for s in range(self.segments)])
            if not torch.equal(inputs, x):
                raise RuntimeError("leancompile: a reweighted micro-step's backbone input differs from the "
                                   "rollout's; the rows/steps mapping is wrong (please report this)")
            return torch.cat([torch.stack([k[1][s] for k in kept]) for s in range(self.segments)])

        return call

    def reference_velocity(self, micro, compute):
        """The KL reference runs once per (sample, step), in the rollout's first loss head, as native runs it once
        in the update; the second head (``A = 0``) and the update's heads read it back while the weights are the
        rollout's."""
        s = self.state
        keys = list(zip(micro.rows.tolist(), micro.steps.tolist()))
        if self.window_refusal() is None and all(k in s.reference for k in keys):
            if not torch.equal(torch.stack([s.reference[k][0] for k in keys]), micro.x):
                raise RuntimeError("leancompile: a loss head's reference input differs from the rollout's; the "
                                   "rows/steps mapping is wrong (please report this)")
            return torch.stack([s.reference[k][1] for k in keys])
        velocity = compute(micro)
        if self._keeping_reference:
            for key, x, v in zip(keys, micro.x, velocity):
                if key not in s.reference:
                    s.reference[key] = (x, v)
                    s.kept_bytes += x.numel() * x.element_size() + v.numel() * v.element_size()
        return velocity

    def after_rollout_step(self, step, rows, x, x_next, log_prob, cond, loss_fn) -> None:
        s, call = self.state, self.state.call
        if call is not None and call.step == step:
            self._provisional_backward(call, x, x_next, log_prob, cond, loss_fn)
            s.call = None
        if s.mode == "accumulators" and step == self.config.num_steps - 1:
            self._fold_finished(rows, x_next)

    def _provisional_backward(self, call, x, x_next, log_prob, cond, loss_fn) -> None:
        from ..trainers.grpo import MicroStep

        s, b = self.state, len(call.rows)
        positions = [p for p in self.trained_at(call.step, call.rows).nonzero().flatten().tolist()
                     if int(call.rows[p]) in s.window]
        cot_policy = torch.zeros_like(call.output)
        cot_free = torch.zeros_like(call.output) if self.advantage_free else None
        sigmas = self.sigmas
        if positions:
            at = torch.tensor(positions, device=x.device)
            call.leaf_rows = (torch.arange(self.segments, device=x.device)[:, None] * b + at).flatten()
            grads = []
            self._keeping_reference = True
            try:
                for a in ((1.0, 0.0) if self.advantage_free else (1.0,)):
                    call.leaf = None
                    micro = MicroStep(rows=call.rows[positions].to(x.device), steps=torch.full_like(at, call.step),
                                      x=x[at], prev_sample=x_next[at], sigma=sigmas[call.step].expand(len(at)),
                                      sigma_next=sigmas[call.step + 1].expand(len(at)), cond=cond.index(at),
                                      log_prob_old=log_prob[at], advantages=torch.full((len(at),), a, dtype=x.dtype))
                    loss, _ = loss_fn(micro)
                    # The head's loss is the mean over its rows of per-row losses: undo the mean.
                    grads.append(len(at) * torch.autograd.grad(loss, call.leaf, allow_unused=True,
                                                               materialize_grads=True)[0]
                                 if call.leaf is not None and loss.requires_grad else None)
            finally:
                self._keeping_reference = False
            if grads[0] is not None:
                cot_policy[call.leaf_rows] = grads[0] - (grads[1] if len(grads) > 1 else 0)
                if len(grads) > 1:
                    cot_free[call.leaf_rows] = grads[1]
            values = call.output.detach()
            for p in positions:
                rows = torch.arange(self.segments, device=x.device) * b + p
                s.kept[(int(call.rows[p]), call.step)] = (call.inputs[rows], values[rows])
                s.kept_bytes += 2 * values[rows].numel() * values.element_size()
        has_free = cot_free is not None and bool(cot_free.any())
        policy = self.per_sample.gradients(call.output, cot_policy.to(call.output.dtype), b, retain_graph=has_free)
        free = self.per_sample.gradients(call.output, cot_free.to(call.output.dtype), b) if has_free else None
        for p in positions:
            sample = int(call.rows[p])
            self._add("policy", sample, [g[p] for g in policy])
            if free is not None:
                self._add("free", sample, [g[p] for g in free])

    def _add(self, kind: str, sample: int, grads: list[torch.Tensor]) -> None:
        s = self.state
        store = getattr(s, kind)
        if sample in store:
            for buf, g in zip(store[sample], grads):
                buf += g
        elif s.mode == "per-sample":
            # One buffer per parameter with a row per window sample: the correction contracts it as it is,
            # instead of stacking every sample's buffers into a second copy.
            if kind not in s.rows:
                s.rows[kind] = [torch.zeros(len(s.slots), *p.shape, dtype=p.dtype, device=p.device)
                                for p in self.trainable]
                self._count(+len(s.slots))
            store[sample] = [rows[s.slots[sample]] for rows in s.rows[kind]]
            for buf, g in zip(store[sample], grads):
                buf.copy_(g)
        else:
            store[sample] = [g.clone() for g in grads]
            self._count(+1)

    def _count(self, delta: int) -> None:
        s = self.state
        s.buffer_bytes += delta * self._buffer_size
        s.peak_buffer_bytes = max(s.peak_buffer_bytes, s.buffer_bytes)
        s.peak_buffers = max(s.peak_buffers, s.buffer_bytes // max(self._buffer_size, 1))

    def _fold_finished(self, rows: torch.Tensor, final: torch.Tensor) -> None:
        """Score the samples that just finished and fold their buffers into their group's moments."""
        s, g = self.state, self.config.group_size
        rows = rows.cpu().tolist()
        rewards = torch.as_tensor(self.reward_fn(final.float(), [s.prompts[r] for r in rows])).double()
        for sample, reward in zip(rows, rewards.tolist()):
            s.early_rewards[sample] = reward
            if sample not in s.policy:
                continue
            policy, free = s.policy.pop(sample), s.free.pop(sample, None)
            group = s.groups.get(sample // g)
            if group is None:
                group = s.groups[sample // g] = GroupMoments(
                    reward, [torch.zeros_like(t) for t in policy], [torch.zeros_like(t) for t in policy],
                    [torch.zeros_like(t) for t in policy] if free is not None else None)
                self._count(+2 + (free is not None))
            for c, p_, t in zip(group.centred, group.plain, policy):
                c.add_(t, alpha=reward - group.offset)
                p_.add_(t)
            if free is not None:
                if group.free is None:
                    group.free = [torch.zeros_like(t) for t in free]
                    self._count(+1)
                for h, t in zip(group.free, free):
                    h.add_(t)
            self._count(-1 - (free is not None))

    # ------------------------------------------------------------------------------------------- update

    def begin_update(self, rollout, advantages) -> None:
        s = self.state
        s.advantages = advantages
        if not s.kept:
            s.usable, s.unusable_reason = False, "the rollout backpropagated nothing"
        elif s.mode == "accumulators":
            s.unusable_reason = self._accumulator_refusal(rollout.rewards, advantages) or ""
            s.usable = not s.unusable_reason
        else:
            s.usable, s.unusable_reason = True, ""
        if not s.usable:  # the buffers cannot give the native gradient: free them, the update recomputes
            s.policy.clear(), s.free.clear(), s.rows.clear(), s.groups.clear()

    def _accumulator_refusal(self, rewards, advantages) -> str | None:
        cfg, s = self.config, self.state
        early = torch.tensor([s.early_rewards[i] for i in range(len(rewards))], dtype=torch.float64)
        tolerance = 4 * torch.finfo(advantages.dtype).eps * float(early.abs().max().clamp(min=1))
        if float((early - rewards.double().cpu()).abs().max()) > tolerance:
            return "reward_fn scores a sample differently alone than in the full batch"
        kept = int((advantages != 0).sum()) if cfg.drop_zero_advantages else len(advantages)
        tbs, ga = cfg.train_batch_size, cfg.gradient_accumulation_steps
        if kept > ga * tbs:
            return f"{kept} kept samples do not fit the first optimizer step ({ga} x {tbs})"
        if kept > tbs and kept % tbs:
            return f"{kept} kept samples make micro-batches of unequal size ({tbs})"
        if s.groups and any(m.free is not None for m in s.groups.values()) and cfg.drop_zero_advantages:
            zero = (advantages == 0).reshape(-1, cfg.group_size)
            if bool((zero.any(1) & ~zero.all(1)).any()):
                return "a sample with advantage 0 in a group with spread: its advantage-free terms are dropped"
        return None

    def micro_step_loss(self, micro, loss_fn):
        s = self.state
        refusal = self.window_refusal() or (None if s.usable else s.unusable_reason)
        if refusal is None:
            missing = [(r, t) for r, t in zip(micro.rows.tolist(), micro.steps.tolist()) if (r, t) not in s.kept]
            if missing:
                refusal = f"rows/steps {missing[:3]} were not backpropagated by the rollout"
        if refusal is not None:
            self.record("recompute", refusal)
            return loss_fn(micro)
        self.record("reweight", "provisional gradient from the rollout, scaled by the advantage at the correction")
        self._serving = micro
        try:
            with torch.no_grad():
                loss, info = loss_fn(micro)
        finally:
            self._serving = None
        sink = []
        for r in micro.rows.tolist():
            s.weights.setdefault(r, []).append((sink, len(micro.rows)))
        anchor = torch.zeros((), requires_grad=True)
        return _LossWeight.apply(loss, anchor, sink), info

    def before_optimizer_step(self, syncing) -> bool:
        s = self.state
        corrected = s.window_open and bool(s.weights)
        if corrected:
            grads = self._correction()
            # Accumulated by autograd, like any backward's: a data-parallel engine's hooks see (and sync) them.
            with syncing:
                torch.autograd.backward(self.trainable, grads)
        s.policy.clear(), s.free.clear(), s.rows.clear(), s.groups.clear(), s.weights.clear()
        s.buffer_bytes = 0
        super().before_optimizer_step(syncing)
        return corrected

    def _sample_weights(self) -> dict[int, float]:
        """Each reweighted sample's weight ``w / |micro-batch|``; its trained steps must share it (they do in
        the native update, which scales every micro-step alike)."""
        out = {}
        for sample, sinks in self.state.weights.items():
            weights = [w / size for sink, size in sinks for w in sink]
            if not weights:  # its loss was never backpropagated: it adds nothing, as natively
                continue
            if max(weights) - min(weights) > 1e-12 * max(abs(w) for w in weights):
                raise RuntimeError("leancompile: the trainer weights one sample's micro-steps differently; "
                                   "Reweight needs one weight per sample; use schedule='retain'")
            out[sample] = weights[0]
        return out

    def _correction(self) -> list[torch.Tensor]:
        s, cfg = self.state, self.config
        weights = self._sample_weights()
        adv = s.advantages.detach().cpu().double()
        if s.mode == "per-sample":
            # Per row of the buffers; a window sample no micro-step reweighted weighs 0.
            w = torch.zeros(len(s.slots), dtype=torch.float64)
            advantage = torch.zeros(len(s.slots), dtype=torch.float64)
            for sample, weight in weights.items():
                w[s.slots[sample]], advantage[s.slots[sample]] = weight, adv[sample]
            return self.correction.per_sample(w * advantage, w, s.rows["policy"], s.rows.get("free"))
        c = set(weights.values())
        kept = set((adv != 0).nonzero().flatten().tolist()) if cfg.drop_zero_advantages else set(range(len(adv)))
        if len(c) != 1 or set(weights) != kept:
            raise RuntimeError("leancompile: moment accumulators need every kept sample reweighted with one weight")
        c = c.pop()
        rewards = torch.tensor([s.early_rewards[i] for i in range(len(adv))], dtype=torch.float64)
        mean, std = group_statistics(rewards, cfg.group_size, unbiased=cfg.adv_unbiased, global_std=cfg.global_std)
        groups = sorted(s.groups)
        moments = [s.groups[g] for g in groups]
        scale = torch.tensor([c / (float(std[g]) + cfg.adv_eps) for g in groups], dtype=torch.float64)
        shift = torch.tensor([float(mean[g]) - m.offset for g in groups for m in [s.groups[g]]], dtype=torch.float64)
        trained = torch.tensor([c if all(i in weights for i in range(g * cfg.group_size, (g + 1) * cfg.group_size))
                                else 0.0 for g in groups], dtype=torch.float64)
        stack = lambda attr: [torch.stack([getattr(m, attr)[j] for m in moments]) for j in range(len(self.trainable))]
        free = stack("free") if moments[0].free is not None else None
        return self.correction.moments(scale, shift, trained, stack("centred"), stack("plain"), free)
