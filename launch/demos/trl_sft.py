"""TRL's SFTTrainer in fp16 with shardscale: skips reported, the LR held, the scaler resumed.

    torchrun --standalone --nproc-per-node 2 launch/demos/trl_sft.py --inject-inf-at 2

A tiny randomly initialised Llama (its tokenizer built in code: no download) trained by TRL's
``SFTTrainer`` with the Trainer's defaults, fused AdamW and a linear LR decay, through
:class:`shardscale.integrations.accelerate.ShardScaleTrainerMixin`. On CPU ranks accelerate runs
DDP (``MULTI_CPU``); ``--inject-inf-at K --inject-rank R`` writes an inf into rank R's gradient
after DDP's reduction at step K, so only that rank sees it. Every rank prints one JSON line per
step: whether the step was skipped (as the Trainer sees it), the scale, the learning rate.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from _common import leave, plant
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback
from trl import SFTConfig
from trl import SFTTrainer as TRLSFTTrainer

from shardscale import ShardedGradScaler
from shardscale.integrations.accelerate import ShardScaleTrainerMixin

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "ran",
    "on",
    "under",
    "mat",
    "log",
    "big",
    "small",
    "red",
    "blue",
    "and",
    "then",
]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({word: 4 + i for i, word in enumerate(WORDS)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


def tiny_model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def tiny_dataset(count: int = 64) -> Dataset:
    generator = torch.Generator().manual_seed(0)
    texts = []
    for _ in range(count):
        length = int(torch.randint(4, 10, (1,), generator=generator))
        picks = torch.randint(len(WORDS), (length,), generator=generator)
        texts.append(" ".join(WORDS[i] for i in picks))
    return Dataset.from_dict({"text": texts})


class SFTTrainer(ShardScaleTrainerMixin, TRLSFTTrainer):  # type: ignore[misc]
    """TRL's SFTTrainer training fp16 with shardscale; optionally planting an inf."""

    inject_at: int = -1
    inject_rank: int = 0

    def make_shardscale_scaler(self) -> ShardedGradScaler:
        return ShardedGradScaler(init_scale=2.0**10, growth_interval=2)

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        loss = super().training_step(model, inputs, num_items_in_batch)  # scaled backward done
        if (
            self.state.global_step == self.inject_at
            and self.accelerator.process_index == self.inject_rank
        ):
            plant(model.parameters())  # after DDP's all-reduce: this rank's alone
        return loss


class Report(TrainerCallback):  # type: ignore[misc]
    """One JSON line per step and rank, as the Trainer saw the step."""

    def __init__(self, trainer: SFTTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        accelerator = self.trainer.accelerator
        print(
            json.dumps(
                {
                    "rank": accelerator.process_index,
                    "step": state.global_step,
                    "skipped": accelerator.optimizer_step_was_skipped,
                    "scale": accelerator.scaler.get_scale(),
                    "lr": self.trainer.lr_scheduler.get_last_lr()[0],
                    "fused": bool(self.trainer.optimizer.optimizer.defaults.get("fused")),
                }
            ),
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--inject-inf-at", type=int, default=-1, help="0-based step (-1: never)")
    parser.add_argument("--inject-rank", type=int, default=1)
    parser.add_argument("--output-dir", default="runs/trl_sft")
    parser.add_argument("--save-steps", type=int, default=0, help="checkpoint every K steps")
    parser.add_argument("--resume", help="a checkpoint folder to resume from")
    args = parser.parse_args()

    tokenizer = tiny_tokenizer()
    config = SFTConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        logging_steps=1,
        report_to="none",
        max_length=32,
        use_cpu=not torch.cuda.is_available(),
        fp16=True,
        bf16=False,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        seed=0,
        disable_tqdm=True,
    )
    SFTTrainer.inject_at, SFTTrainer.inject_rank = args.inject_inf_at, args.inject_rank
    trainer = SFTTrainer(
        model=tiny_model(tokenizer),
        args=config,
        train_dataset=tiny_dataset(),
        processing_class=tokenizer,
    )
    trainer.add_callback(Report(trainer))
    trainer.train(resume_from_checkpoint=args.resume)
    print(
        json.dumps(
            {
                "rank": trainer.accelerator.process_index,
                "final": trainer.accelerator.scaler.state_dict(),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
    leave()  # past torch's C++ teardown, which may abort at exit (_common.py)
