"""The tiny GRPO run of the TRL tests (tests/test_trl.py, tests/trl_worker.py): a 2-layer tiny
tonp model, a byte-level tokenizer built here, digit prompts and a reward with spread.

    model, w0 = tiny_policy()
    trainer = make_trainer(model, out_dir, num_iterations=2, generator=url)
    trainer.train(); trainer.state.log_history
"""
from __future__ import annotations

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SAMPLING = ("sampling/sampling_logp_difference/max", "sampling/importance_sampling_ratio/min",
            "sampling/importance_sampling_ratio/max")


def tiny_policy(seed: int = 0):
    """(a fresh tiny tonp model, a copy of its initial parameters)."""
    from tonp_models import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig.preset("tiny", num_hidden_layers=2,
                                                      mlp_only_layers=[1]))
    return model, {k: v.detach().clone() for k, v in model.named_parameters()}


def ascii_reward(prompts, completions, completion_ids, **kw):
    """The fraction of ASCII tokens in a completion: a random model's groups have spread."""
    return [sum(t < 128 for t in c) / max(len(c), 1) for c in completion_ids]


def dataset(n: int = 8):
    from datasets import Dataset
    prompts = ["407>", "12>", "9981>", "55>", "3>", "60>", "781>", "2024>"]
    return Dataset.from_dict({"prompt": [prompts[i % len(prompts)] for i in range(n)]})


def make_trainer(model, out_dir, *, generator=None, weights_dir=None, steps: int = 3,
                 batch: int = 4, generations: int = 4, trainer_cls=None, **config):
    from tonp_models.integrations.tokenizer import byte_tokenizer
    from tonp_models.integrations.trl import TonpGRPOTrainer, tonp_grpo_config
    kw = dict(output_dir=str(out_dir), per_device_train_batch_size=batch,
              num_generations=generations, max_completion_length=6, max_steps=steps,
              logging_steps=1, report_to="none", save_strategy="no", learning_rate=1e-2,
              seed=0, disable_tqdm=True, dataloader_num_workers=0)
    kw.update(config)
    return (trainer_cls or TonpGRPOTrainer)(
        model, reward_funcs=ascii_reward, args=tonp_grpo_config(**kw),
        train_dataset=dataset(), processing_class=byte_tokenizer(), generator=generator,
        weights_dir=weights_dir)


def sampling_rows(log_history):
    """The logged rows of the steps that generated (those carry TRL's sampling/* metrics)."""
    return [r for r in log_history if "loss" in r and SAMPLING[0] in r]
