"""TRL's ``GRPOTrainer`` natively and with ``leancompile.wrap``: a row of the drop-in loops' table (``llm/trl``).

One step is one generation of TRL's loop: ``generate``, the old log-probabilities over the generation batch
without grad, then ``num_iterations=2`` passes over it, shuffled, in micro-batches (one optimizer step per pass).
``trainer.train()`` runs in a thread of its own that pauses at each generation's end, so that a native and a
wrapped trainer take their steps in alternation in one process, as the other loops' rows are timed.
"""
from __future__ import annotations

import os
import tempfile
import threading
from dataclasses import dataclass

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

import leancompile
from leancompile.integrations import trl as trl_integration

CHARACTERS = "abcdefgh "


def _reward(completions, **_):
    """The number of ``a`` in the completion, minus a little per character: the groups' rewards differ."""
    return [float(c.count("a")) - 0.1 * len(c) for c in completions]


@dataclass(frozen=True)
class TrlConfig:
    prompts: int = 8  # per generation
    group: int = 8  # TRL's num_generations
    micro_batch: int = 32  # per_device_train_batch_size; the generation batch is scored in chunks of it
    max_new_tokens: int = 8
    hidden: int = 256
    layers: int = 4
    lr: float = 1e-3
    dtype: torch.dtype = torch.float32
    schedule: str = "retain"
    # Where the loop wraps: "model" (``model = leancompile.wrap(model)`` before the trainer is built) or "decoder"
    # (``trainer.model.model`` once it is built)
    wrap_where: str = "model"
    seed: int = 0
    device: str = "cpu"  # "cuda": the trainer's own placement (use_cpu=False)


def tiny_causal_lm(hidden: int, layers: int, dtype: torch.dtype, folder) -> tuple:
    """A Qwen2 causal LM of random weights saved in ``folder`` (TRL builds its KL reference from the policy's
    path) and a character-level tokenizer: nothing is downloaded."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(CHARACTERS)}}
    characters = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    characters.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    characters.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=characters, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>")
    config = Qwen2Config(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=1,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(dtype).save_pretrained(folder)
    return folder, tokenizer


def grpo_trainer(folder, tokenizer, prompts: list[str], schedule: str | None, wrap_where: str = "model",
                 dtype: torch.dtype = torch.float64, device: str = "cpu", **config):
    """TRL's ``GRPOTrainer`` on the model saved in ``folder`` with ``num_iterations=2`` and the old
    log-probabilities computed (gradient accumulation 2 < 2 passes); ``config``: more ``GRPOConfig`` fields.
    ``schedule`` None: native; else the model is wrapped with it where ``wrap_where`` says, and under Reweight
    the trainer hands its loss over (:mod:`leancompile.integrations.trl`). Returns the trainer and the wrapped
    module (None natively)."""
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    if wrap_where not in ("model", "decoder"):
        raise ValueError(f"wrap_where must be 'model' or 'decoder'; got {wrap_where!r}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    wrapped = None
    if schedule is not None and wrap_where == "model":
        model = wrapped = leancompile.wrap(model, schedule=schedule)
    config = {"per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 6,
              "learning_rate": 1e-2, "max_steps": 4, "seed": 0, **config}
    args = trl.GRPOConfig(num_iterations=2, gradient_accumulation_steps=2, use_vllm=False, report_to=[], bf16=False,
                          use_cpu=device == "cpu", save_strategy="no", logging_steps=1, disable_tqdm=True, **config)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=_reward, args=args, processing_class=tokenizer,
                              train_dataset=Dataset.from_dict({"prompt": prompts}))
    trainer.remove_callback(PrinterCallback)  # the metrics stay in trainer.state.log_history
    if schedule is not None and wrap_where == "decoder":
        trainer.model.model = wrapped = leancompile.wrap(trainer.model.model, schedule=schedule)
    if schedule == "reweight":
        trl_integration.reweight(trainer)
    return trainer, wrapped


class TrlLoop:
    """A ``GRPOTrainer`` seen as the other loops are: ``step()`` runs one generation (see the module's docstring),
    ``model`` is what it trains (the wrapped module, or the same module natively)."""

    def __init__(self, config: TrlConfig = TrlConfig(), use_leancompile: bool = True):
        self.config = c = config
        self.folder = tempfile.TemporaryDirectory()
        folder, tokenizer = tiny_causal_lm(c.hidden, c.layers, c.dtype, self.folder.name)
        prompts = ["".join(CHARACTERS[(i + j) % 8] for j in range(6)) for i in range(c.prompts)]
        self.trainer, wrapped = grpo_trainer(
            folder, tokenizer, prompts * 1000, c.schedule if use_leancompile else None, c.wrap_where, c.dtype, c.device,
            per_device_train_batch_size=c.micro_batch, num_generations=c.group,
            max_completion_length=c.max_new_tokens, learning_rate=c.lr, max_steps=10**6,
            lr_scheduler_type="constant", seed=c.seed, output_dir=os.path.join(self.folder.name, "out"))
        decoder = c.wrap_where == "decoder"
        self.model = wrapped if wrapped is not None else (self.trainer.model.model if decoder else self.trainer.model)
        # One generation feeds num_iterations (2) optimizer steps of gradient_accumulation_steps (2) micro-batches
        self.optimizer_steps = 2
        self._go, self._done = threading.Semaphore(0), threading.Semaphore(0)
        self._modes: list = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._train, daemon=True)
        self.trainer.add_callback(_PauseEachGeneration(self))

    def step(self) -> float:
        """One generation; returns its mean reward. The caller's dispatch modes (a FLOP counter) see it too."""
        self._modes = _get_current_dispatch_mode_stack()
        if not self._thread.is_alive():
            self._thread.start()
        self._go.release()
        self._done.acquire()
        if self._error is not None:
            raise self._error
        return next(h["reward"] for h in reversed(self.trainer.state.log_history) if "reward" in h)

    def _train(self) -> None:
        self._go.acquire()
        self._enter()
        try:
            self.trainer.train()
        except BaseException as error:  # handed to the caller's thread
            self._error = error
        finally:
            self._done.release()

    def _enter(self) -> None:
        for mode in self._modes:
            _push_mode(mode)

    def _leave(self) -> None:
        for _ in self._modes:
            _pop_mode()

    def pause(self) -> None:
        """At a generation's end: hand the caller its step, wait for the next one."""
        self._leave()
        self._done.release()
        self._go.acquire()
        self._enter()


class _PauseEachGeneration(TrainerCallback):
    """Pauses the trainer's thread after each generation's optimizer steps."""

    def __init__(self, loop: TrlLoop):
        self.loop = loop

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.loop.optimizer_steps == 0:
            self.loop.pause()
        return control
