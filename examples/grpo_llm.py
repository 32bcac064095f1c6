"""A GRPO loop for a causal language model, written the way LLM RL loops write theirs (TRL, veRL): ``generate``,
the old log-probabilities under ``no_grad`` over the padded sequences, then the clipped token-level loss on the
same sequences, in micro-batches, one optimizer step per rollout.

The model is a tiny ``transformers`` ``LlamaForCausalLM`` built from a config and trained from scratch; the task is
verifiable: given two digits ``a , b =``, answer the larger, rewarded 1 for the right digit and 0.5 more when the
end of sequence follows it (1.5 at most).
Using leancompile changes one line (marked ``# leancompile``): the old log-probabilities' forward is kept, and each
micro-step before the optimizer step is served from it instead of running the model again; under
``Config(schedule="reweight")`` three more lines hand the update's loss to ``provisional``.

Run ``python examples/grpo_llm.py [--native] [--steps N]`` (200 steps by default: the mean reward climbs).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import leancompile

COMMA, EQUALS, BOS, EOS, PAD = 10, 11, 12, 13, 14  # the digits are tokens 0-9


@dataclass(frozen=True)
class Config:
    prompts: int = 16
    group: int = 8
    micro_batch: int = 64  # the update's; the old log-probabilities run over the whole rollout at once
    max_new_tokens: int = 3
    clip: float = 0.2
    lr: float = 3e-3
    hidden: int = 64
    layers: int = 2
    seed: int = 0
    dtype: torch.dtype = torch.float32
    autocast: torch.dtype | None = None  # e.g. torch.bfloat16: the loop's forwards run under autocast
    device: str = "cpu"
    schedule: str = "retain"  # leancompile's; "reweight" also hands it the update's loss once the rollout is done


class Loop:
    """The model, its optimizer and the task: ``step()`` runs one GRPO step."""

    def __init__(self, config: Config = Config(), use_leancompile: bool = True):
        self.config = c = config
        self.use_leancompile = use_leancompile
        torch.manual_seed(c.seed)  # the weights; generate samples from torch's own generator too
        model_config = LlamaConfig(vocab_size=15, hidden_size=c.hidden, intermediate_size=2 * c.hidden,
                                   num_hidden_layers=c.layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=16,
                                   bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
        self.model = LlamaForCausalLM(model_config).to(c.device, c.dtype)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=c.lr)
        if use_leancompile:
            self.model = leancompile.wrap(self.model, schedule=c.schedule)  # leancompile
        self.generator = torch.Generator().manual_seed(c.seed)  # the questions

    def questions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``prompts`` questions ``BOS a , b =`` and their answers, the larger digit."""
        a, b = torch.randint(0, 10, (2, self.config.prompts), generator=self.generator)
        questions = torch.stack([torch.full_like(a, BOS), a, torch.full_like(a, COMMA), b, torch.full_like(a, EQUALS)],
                                1)
        return questions.to(self.config.device), torch.maximum(a, b).to(self.config.device)

    @torch.no_grad()
    def rollout(self, questions: torch.Tensor):
        """``group`` sampled completions per question: the padded sequences, their attention mask, and which of
        their tokens are completion tokens (up to and including the end of sequence)."""
        sequences = self.model.generate(questions, attention_mask=torch.ones_like(questions), do_sample=True,
                                        max_new_tokens=self.config.max_new_tokens, top_k=0,
                                        num_return_sequences=self.config.group, pad_token_id=PAD, eos_token_id=EOS)
        completion = torch.zeros_like(sequences, dtype=torch.bool)
        completion[:, questions.shape[1]:] = sequences[:, questions.shape[1]:] != PAD
        return sequences, (sequences != PAD).long(), completion

    def rewards(self, sequences: torch.Tensor, answers: torch.Tensor, prompt_length: int) -> torch.Tensor:
        """1 where the completion is the answer, 0.5 more where the end of sequence follows it (exact match)."""
        answer = answers.repeat_interleave(self.config.group, 0)
        right = sequences[:, prompt_length] == answer
        ends = sequences[:, prompt_length + 1] == EOS
        return right.to(torch.float32) + 0.5 * (right & ends).to(torch.float32)

    def token_log_probs(self, sequences, mask) -> torch.Tensor:
        """Log-probability of each token given the ones before it (the first token has none: dropped)."""
        autocast = self.config.autocast
        with torch.autocast(torch.device(self.config.device).type, dtype=autocast or torch.bfloat16,
                            enabled=autocast is not None):
            logits = self.model(input_ids=sequences, attention_mask=mask, use_cache=False).logits[:, :-1]
        return torch.log_softmax(logits.to(self.config.dtype), -1).gather(-1, sequences[:, 1:, None]).squeeze(-1)

    def loss(self, batch: slice, sequences, mask, old, tokens, advantages) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch's clipped token-level loss (normalised by all completion tokens) and its ratios."""
        c = self.config
        new = self.token_log_probs(sequences[batch], mask[batch])
        ratio = torch.exp(new - old[batch])
        advantage = advantages[batch, None].to(new.dtype)
        loss = -torch.minimum(ratio * advantage, torch.clamp(ratio, 1 - c.clip, 1 + c.clip) * advantage)
        return (loss * tokens[batch]).sum() / tokens.sum(), ratio

    def step(self) -> float:
        """One GRPO step; returns the rollout's mean reward."""
        c = self.config
        questions, answers = self.questions()
        sequences, mask, completion = self.rollout(questions)
        reward = self.rewards(sequences, answers, questions.shape[1])
        grouped = reward.reshape(-1, c.group)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).reshape(-1)
        with torch.no_grad():
            old = self.token_log_probs(sequences, mask)
        tokens = completion[:, 1:].to(old.dtype)
        batches = [slice(start, start + c.micro_batch) for start in range(0, len(sequences), c.micro_batch)]
        if self.use_leancompile and c.schedule == "reweight":  # leancompile: the update's loss at one advantage
            self.model.provisional(lambda a: sum(self.loss(b, sequences, mask, old, tokens,
                                                           torch.full_like(advantages, a))[0] for b in batches))
        self.optimizer.zero_grad()
        self.ratios = []  # each micro-step's importance ratios on its completion tokens
        for batch in batches:
            loss, ratio = self.loss(batch, sequences, mask, old, tokens, advantages)
            self.ratios.append(ratio.detach()[tokens[batch].bool()])
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return float(reward.mean())


if __name__ == "__main__":
    from loop_cli import run  # beside this script

    run(Loop, __doc__.splitlines()[0], steps=200)
