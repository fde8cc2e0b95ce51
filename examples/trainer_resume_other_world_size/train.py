# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Train a small Llama with the Hugging Face Trainer and a ZeRO DeepSpeed config, saving a
checkpoint every ``--save_steps`` steps; ``--resume_from_checkpoint`` resumes from one, on any
number of ranks (docs/resume-other-topology.md): train on 2 ranks, resume on 1:

    deepspeed --num_accelerators 2 examples/trainer_resume_other_world_size/train.py --output_dir out --max_steps 2
    deepspeed --num_accelerators 1 examples/trainer_resume_other_world_size/train.py --output_dir out --max_steps 4 \
        --resume_from_checkpoint out/checkpoint-2

``--load_universal`` resumes from the checkpoint converted by ds_to_universal instead (the offline
path, for what a load cannot reshard):

    python -m deepspeed.checkpoint.ds_to_universal --input_folder out/checkpoint-2/global_step2 \
        --output_folder out/checkpoint-2/global_step2_universal
    deepspeed --num_accelerators 1 examples/trainer_resume_other_world_size/train.py --output_dir out --max_steps 4 \
        --resume_from_checkpoint out/checkpoint-2 --load_universal

The DeepSpeed config names no optimizer, so the Trainer builds its own AdamW with two parameter
groups: ``--weight_decay`` on matrices, none on norm weights and biases. A resume with another
optimizer (``--optim adagrad``) is refused, naming the states each keeps.

With ``--check_resumed_weights`` the resumed run checks, before its first step, that its weights
are those of the checkpoint (as zero_to_fp32 reads them) and that each optimizer parameter group
has its own weight decay, and prints ``resumed weights match``.
"""

import argparse

import torch
import transformers

import deepspeed
import deepspeed.comm as dist
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

SEQ_LEN = 16
VOCAB = 64


class TokenDataset(torch.utils.data.Dataset):

    def __init__(self, size=64):
        self.input_ids = torch.randint(0, VOCAB, (size, SEQ_LEN), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.input_ids)

    def __getitem__(self, index):
        return {"input_ids": self.input_ids[index], "labels": self.input_ids[index]}


class CheckResumedWeights(transformers.TrainerCallback):
    """At the start of training, after the Trainer has loaded the checkpoint."""

    def __init__(self, checkpoint):
        self.expected = get_fp32_state_dict_from_zero_checkpoint(checkpoint)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        params = dict(model.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values())):
            for name, param in params.items():
                assert torch.equal(param.detach().cpu(), self.expected[name]), name
        weight_decays = [group["weight_decay"] for group in optimizer.param_groups]
        assert weight_decays == [args.weight_decay, 0.0], weight_decays
        if dist.get_rank() == 0:
            print("resumed weights match", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--zero_stage", type=int, default=2)
    parser.add_argument("--max_steps", type=int, required=True)
    parser.add_argument("--save_steps", type=int, default=2)
    parser.add_argument("--weight_decay", type=float, default=0.1)
    parser.add_argument("--optim", help="the Trainer's optimizer, if not its default AdamW")
    parser.add_argument("--resume_from_checkpoint")
    parser.add_argument("--load_universal", action="store_true")
    parser.add_argument("--check_resumed_weights", action="store_true")
    parser.add_argument("--async_save", action="store_true", help="save checkpoints in the background")
    args, _ = parser.parse_known_args()  # the launcher adds --local_rank

    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {
            "stage": args.zero_stage
        },
        "checkpoint": {
            "load_universal": args.load_universal,
            "async_save": args.async_save
        },
    }
    training_args = transformers.TrainingArguments(output_dir=args.output_dir,
                                                   use_cpu=True,
                                                   deepspeed=ds_config,
                                                   per_device_train_batch_size=2,
                                                   max_steps=args.max_steps,
                                                   learning_rate=1e-2,
                                                   weight_decay=args.weight_decay,
                                                   save_strategy="steps",
                                                   save_steps=args.save_steps,
                                                   logging_steps=1,
                                                   report_to=[],
                                                   **({"optim": args.optim} if args.optim else {}))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(vocab_size=VOCAB,
                                 hidden_size=32,
                                 intermediate_size=64,
                                 num_hidden_layers=2,
                                 num_attention_heads=4,
                                 num_key_value_heads=2,
                                 max_position_embeddings=SEQ_LEN))
    callbacks = []
    if args.check_resumed_weights:
        callbacks.append(CheckResumedWeights(args.resume_from_checkpoint))
    trainer = transformers.Trainer(model=model, args=training_args, train_dataset=TokenDataset(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    # Shut the process group down before the interpreter does: left to exit, a rank can abort in
    # teardown ("terminate called without an active exception") after it has finished.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
