"""Training machinery for your own loops (RL, pretraining, finetuning); see docs/training.md.

    optim        MasterWeights (fp32 copies of bf16 params), build_optimizer (AdamW), warmup_cosine
    grad_sync    GradSync: DP / expert-DP averaging and global-norm clipping over TP / EP shards
    checkpoints  CheckpointManager: atomic, keep-last-N, checksummed, bit-exact resume
    metrics      MetricLogger (JSONL + stdout + TensorBoard), read_jsonl, plot_curves
    data         tokenizers, token files, samplers with a resumable position
    trainer      Trainer: the above in one object; build_model
    loop         fit (the supervised loop), lm_loss / lm_step, response_loss / _step, evaluate
    rundir       prepare_out_dir: one run per output directory (--resume / --overwrite)
    peers        peer_failure: a collective failed by a dead or stalled peer, in one line
    cli          the example scripts' flags, launch (--dist-timeout), run_script, run_supervised
"""
from .checkpoints import CheckpointError, CheckpointManager, read_meta, rng_state, set_rng_state
from .data import (ByteTokenizer, HFTokenizer, IndexSampler, ItemSampler, WindowSampler,
                   check_vocab, load_tokenizer, load_tokens, window_rows)
from .grad_sync import GradSync, expert_grad_divisor
from .loop import (dp_mean, dp_sum, evaluate, fit, lm_loss, lm_step, response_loss,
                   response_step, token_mean_step)
from .metrics import MetricLogger, plot_curves, read_jsonl
from .optim import MasterWeights, build_optimizer, warmup_cosine
from .rundir import prepare_out_dir
from .trainer import Trainer, build_model

__all__ = [
    "CheckpointError", "CheckpointManager", "read_meta", "rng_state", "set_rng_state",
    "ByteTokenizer", "HFTokenizer", "IndexSampler", "ItemSampler", "WindowSampler",
    "check_vocab", "load_tokenizer", "load_tokens", "window_rows",
    "GradSync", "expert_grad_divisor", "dp_mean", "dp_sum", "evaluate", "fit", "lm_loss",
    "response_loss", "lm_step", "response_step", "token_mean_step",
    "MetricLogger", "plot_curves", "read_jsonl", "MasterWeights", "build_optimizer",
    "warmup_cosine", "prepare_out_dir", "Trainer", "build_model",
]
