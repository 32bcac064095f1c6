"""A GRPO loop for a causal language model, written the way LLM RL loops write theirs (TRL, veRL): ``generate``,
the old log-probabilities under ``no_grad`` over the padded sequences, then the clipped token-level loss on the
same sequences, in micro-batches, one optimizer step per rollout.

The model is a tiny ``transformers`` ``LlamaForCausalLM`` built from a config; the task is verifiable: given
``a + b =`` with digits a and b, answer ``(a + b) mod 10``: rewarded 1 for the right digit and 0.5 more when the
end of sequence follows it.
Using leancompile changes one line (marked ``# leancompile``): the old log-probabilities' forward is kept, and each
micro-step before the optimizer step is served from it instead of running the model again.

Run ``python examples/grpo_llm.py [--native] [--steps N]``.
"""
from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import leancompile

PLUS, EQUALS, BOS, EOS, PAD = 10, 11, 12, 13, 14  # the digits are tokens 0-9
PROMPTS, GROUP, MICRO_BATCH, MAX_NEW_TOKENS, CLIP = 8, 8, 32, 3, 0.2


def build(seed: int = 0, dtype=torch.float32, leancompile_wrap: bool = True):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=15, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                         bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    model = LlamaForCausalLM(config).to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if leancompile_wrap:
        model = leancompile.wrap(model)  # leancompile
    return model, optimizer


def prompts(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``PROMPTS`` questions ``BOS a + b =`` and their answers."""
    a, b = torch.randint(0, 10, (2, PROMPTS), generator=generator)
    questions = torch.stack([torch.full_like(a, BOS), a, torch.full_like(a, PLUS), b, torch.full_like(a, EQUALS)], 1)
    return questions, (a + b) % 10


@torch.no_grad()
def rollout(model, questions: torch.Tensor):
    """``GROUP`` sampled completions per question: the padded sequences, their attention mask, and which of
    their tokens are completion tokens (up to and including the end of sequence)."""
    sequences = model.generate(questions, attention_mask=torch.ones_like(questions), do_sample=True,
                               max_new_tokens=MAX_NEW_TOKENS, num_return_sequences=GROUP, pad_token_id=PAD,
                               eos_token_id=EOS, top_k=0)
    completion = torch.zeros_like(sequences, dtype=torch.bool)
    completion[:, questions.shape[1]:] = sequences[:, questions.shape[1]:] != PAD
    return sequences, (sequences != PAD).long(), completion


def rewards(sequences: torch.Tensor, answers: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """1 where the completion is the answer, 0.5 more where the end of sequence follows it (exact match)."""
    answer = answers.repeat_interleave(GROUP, 0)
    right = sequences[:, prompt_length] == answer
    ends = sequences[:, prompt_length + 1] == EOS
    return right.to(torch.float32) + 0.5 * (right & ends).to(torch.float32)


def token_log_probs(model, sequences, mask) -> torch.Tensor:
    """Log-probability of each token given the ones before it (the first token has none: dropped)."""
    logits = model(input_ids=sequences, attention_mask=mask, use_cache=False).logits[:, :-1]
    return torch.log_softmax(logits, -1).gather(-1, sequences[:, 1:, None]).squeeze(-1)


def grpo_step(model, optimizer, generator) -> float:
    questions, answers = prompts(generator)
    sequences, mask, completion = rollout(model, questions)
    reward = rewards(sequences, answers, questions.shape[1])
    grouped = reward.reshape(-1, GROUP)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).reshape(-1)
    with torch.no_grad():
        old = token_log_probs(model, sequences, mask)
    tokens = completion[:, 1:].to(old.dtype)
    optimizer.zero_grad()
    for start in range(0, len(sequences), MICRO_BATCH):
        batch = slice(start, start + MICRO_BATCH)
        new = token_log_probs(model, sequences[batch], mask[batch])
        ratio = torch.exp(new - old[batch])
        advantage = advantages[batch, None].to(new.dtype)
        loss = -torch.minimum(ratio * advantage, torch.clamp(ratio, 1 - CLIP, 1 + CLIP) * advantage)
        loss = (loss * tokens[batch]).sum() / tokens.sum()
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return float(reward.mean())


def main(grpo_steps: int = 2, seed: int = 0, dtype=torch.float32, leancompile_wrap: bool = True):
    """Run ``grpo_steps`` GRPO steps; returns the model and the mean reward of each rollout."""
    model, optimizer = build(seed, dtype, leancompile_wrap)
    generator = torch.Generator().manual_seed(seed)  # the questions; generate samples from torch's own generator
    torch.manual_seed(seed)
    return model, [grpo_step(model, optimizer, generator) for _ in range(grpo_steps)]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--native", action="store_true", help="run without leancompile")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    model, means = main(args.steps, leancompile_wrap=not args.native)
    for start in range(0, len(means), 20):
        window = means[start:start + 20]
        print(f"steps {start:>4}-{start + len(window) - 1:>4}: mean reward {sum(window) / len(window):.3f}")
    if not args.native:
        print("calls:", model.stats())
