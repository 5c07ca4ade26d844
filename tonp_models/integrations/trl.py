"""TRL's GRPOTrainer on tonp: tonp's model scores, tonp's engine generates (docs/trl.md).

    from tonp_models.integrations.trl import TonpGRPOTrainer, tonp_grpo_config
    args = tonp_grpo_config(output_dir="out", num_generations=4, max_completion_length=8)
    trainer = TonpGRPOTrainer(model, reward_funcs=reward, args=args, train_dataset=ds,
                              processing_class=tokenizer)          # generator=URL: a server
    trainer.train()
    # trainer.state.log_history: sampling/sampling_logp_difference/max == 0.0,
    #                            sampling/importance_sampling_ratio/{min,max} == 1.0

TRL's own loop, loss, optimizer and metrics run unchanged; three seams change:
- the policy is `TonpPolicy`, a thin PreTrainedModel around a `Qwen3MoeForCausalLM` (TRL and
  transformers' Trainer read its config, generation_config, tags and parameters);
- `_get_per_token_logps_and_entropies` (old-policy recompute, reference and loss logprobs) drops
  TRL's padding and scores the packed sequences with `token_logprobs`, tonp's order-locked
  forward with autograd, through the (DDP-wrapped) model's forward;
- `_generate_single_turn` rolls out with tonp's engine (in process, or a tonp server that gets
  the weights before each generation) and hands TRL the engine's sampling logprobs, with
  `self.use_vllm` set after construction, so TRL's own vLLM importance-sampling code computes
  and logs the rollout/training mismatch: exactly 0.0 and a ratio of exactly 1.0.
Options tonp cannot honour raise ValueError at construction, naming the option.
"""
from __future__ import annotations

import copy
import dataclasses
import os
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from transformers import GenerationConfig, PreTrainedModel, TrainerCallback
from transformers import Qwen3MoeConfig as HFQwen3MoeConfig
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.callbacks import SyncRefModelCallback

from ..qwen3_moe import Qwen3MoeForCausalLM
from .rollout import InProcessGenerator, ServerGenerator

_STRIDE = 1 << 32           # request ids: (generation call * processes + process) * _STRIDE + i


class TonpPolicy(PreTrainedModel):
    """A `Qwen3MoeForCausalLM` (attribute `tonp`) as the PreTrainedModel TRL trains.

    `forward(sequences, temperature, entropy=False)` -> (logprobs, entropies): per sequence fp32
    [len - 1] `tonp.token_logprobs` (autograd on), and with entropy=True the entropy of
    log_softmax(logits / temperature) at the same rows, [len - 1], without grad (from tonp's
    logits of a second, no-grad forward; stock torch arithmetic: a metric, not a promise).
    `save_pretrained` writes tonp's HF layout (transformers' Qwen3MoeForCausalLM loads it).
    """

    config_class = HFQwen3MoeConfig
    base_model_prefix = "tonp"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False

    def __init__(self, model: Qwen3MoeForCausalLM):
        if not isinstance(model, Qwen3MoeForCausalLM):
            raise TypeError(f"TonpPolicy: model must be a tonp_models.Qwen3MoeForCausalLM, got "
                            f"{type(model).__name__}")
        g = model.groups
        split = {k: getattr(g, f"{k}_size", 1) for k in ("tp", "ep", "pp", "cp")} if g else {}
        if any(n > 1 for n in split.values()):
            raise ValueError(f"TonpPolicy: the model must be whole on each process (TRL runs data "
                             f"parallel over processes); got a model split as {split}")
        hf = model.config.to_hf()
        # tonp's forward returns no router logits: there is no load-balancing loss to weight.
        hf.update(output_router_logits=False, router_aux_loss_coef=0.0)
        super().__init__(HFQwen3MoeConfig(**hf))
        self.tonp = model
        c = model.config
        self.generation_config = GenerationConfig(bos_token_id=c.bos_token_id,
                                                  eos_token_id=c.eos_token_id)

    def forward(self, sequences: Sequence[torch.Tensor], temperature: float = 1.0,
                entropy: bool = False, micro_batch_size: Optional[int] = None):
        lps = self.tonp.token_logprobs(sequences, temperature, micro_batch_size=micro_batch_size)
        ents = None
        if entropy:
            mb = micro_batch_size or max(len(sequences), 1)
            with torch.no_grad():
                ents = [e for i in range(0, len(sequences), mb)
                        for e in self._entropies(sequences[i:i + mb], temperature)]
        return lps, ents

    def _entropies(self, seqs, temperature) -> List[torch.Tensor]:
        """Per sequence fp32 [len - 1]: the entropy of each predicting row's distribution."""
        lens = [len(s) for s in seqs]
        ids = torch.cat([torch.as_tensor(s) for s in seqs]).long()
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        rows = torch.cat([torch.arange(a, b - 1) for a, b in zip(cu[:-1].tolist(),
                                                                  cu[1:].tolist())])
        logits = self.tonp(ids, cu, logits_rows=rows) / temperature             # (R, V) fp32
        logp = torch.log_softmax(logits, -1)
        return list((-(logp.exp() * logp).sum(-1)).split([n - 1 for n in lens]))

    def save_pretrained(self, save_directory, *args, **kwargs) -> None:
        """tonp's HF checkpoint (config.json + safetensors in the hub layout) and the
        generation config; transformers' keyword arguments (state_dict, ...) do not apply."""
        os.makedirs(save_directory, exist_ok=True)
        self.tonp.save_pretrained(save_directory)
        self.generation_config.save_pretrained(save_directory)


def tonp_grpo_config(**kw) -> GRPOConfig:
    """A GRPOConfig with the settings tonp needs where TRL's defaults differ (both refused by
    TonpGRPOTrainer otherwise): bf16=False (tonp runs in the model's own dtype, no autocast),
    activation_checkpointing=False, and use_cpu=True without CUDA. Every other keyword is
    GRPOConfig's."""
    kw.setdefault("bf16", False)
    if "gradient_checkpointing" not in kw:      # transformers 5's name; the old one warns
        kw.setdefault("activation_checkpointing", False)
    if not torch.cuda.is_available():
        kw.setdefault("use_cpu", True)
    return GRPOConfig(**kw)


def check_args(args: GRPOConfig, **trainer_kw) -> None:
    """Raise ValueError naming each GRPOConfig option / trainer argument tonp cannot honour."""
    bad = []

    def refuse(cond, what):
        if cond:
            bad.append(what)
    refuse(args.use_vllm, "use_vllm=True (tonp's engine is the generator; leave it False, TRL's "
           "importance-sampling path runs anyway)")
    defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    for name, default in defaults.items():     # vLLM's own settings: tonp replaces vLLM
        if name.startswith("vllm_") and not name.startswith("vllm_importance_sampling") and \
                getattr(args, name) != default:
            refuse(True, f"{name}={getattr(args, name)!r} (a vLLM setting; tonp replaces vLLM: "
                   f"pass generator=URL for a tonp server)")
    refuse(args.use_transformers_continuous_batching, "use_transformers_continuous_batching")
    refuse(args.repetition_penalty != 1.0, f"repetition_penalty={args.repetition_penalty} "
           f"(tonp samples from softmax(logits / T) with top_k / top_p only)")
    refuse(args.min_p is not None, f"min_p={args.min_p}")
    refuse(bool(args.generation_kwargs), f"generation_kwargs={args.generation_kwargs!r}")
    refuse(not args.temperature > 0, f"temperature={args.temperature} (must be > 0)")
    refuse(args.bf16 or args.fp16, "bf16/fp16=True (autocast mixed precision; tonp runs in the "
           "model's dtype: build Qwen3MoeForCausalLM(dtype=torch.bfloat16) and pass bf16=False)")
    refuse(args.gradient_checkpointing, "gradient_checkpointing / activation_checkpointing=True "
           "(GRPOConfig's default; tonp's model has no activation checkpointing: pass False)")
    refuse(args.cast_lm_head_to_fp32, "cast_lm_head_to_fp32=True (tonp's logprobs are fp32 "
           "already)")
    refuse(args.use_liger_kernel, "use_liger_kernel=True")
    refuse(args.sync_ref_model and args.beta == 0.0, "sync_ref_model=True with beta=0 (no "
           "reference model to sync: TRL's own rule)")
    refuse(args.entropy_coef != 0.0 or args.use_adaptive_entropy,
           "entropy_coef / use_adaptive_entropy (tonp gives entropies without grad)")
    refuse(args.router_aux_loss_coef not in (None, 0.0),
           f"router_aux_loss_coef={args.router_aux_loss_coef} (tonp returns no router logits)")
    refuse(args.loss_type == "vespo" and args.vllm_importance_sampling_mode not in
           ("token_truncate", "token_mask"),
           f"loss_type='vespo' with vllm_importance_sampling_mode="
           f"{args.vllm_importance_sampling_mode!r} (TRL's own rule)")
    refuse(bool(args.deepspeed) or bool(args.fsdp), "deepspeed / fsdp (the in-process engine "
           "needs the whole model on each process; DDP only)")
    for name, value in trainer_kw.items():
        refuse(value is not None, f"{name} (not supported with tonp's generator)")
    if bad:
        raise ValueError("TonpGRPOTrainer: cannot honour " + "; ".join(bad))


class _CloseGenerator(TrainerCallback):
    """Leaves the server's weight-update group when training ends (a next train() rejoins)."""

    def __init__(self, generator):
        self.generator = generator

    def on_train_end(self, args, state, control, **kwargs):
        self.generator.close()


class TonpGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` with tonp's model as the policy and tonp's engine as the generator.

    model: a tonp `Qwen3MoeForCausalLM` (or a TonpPolicy); generator: None (in process: the
    engine runs on the training model itself) or a tonp server URL (weights pushed before every
    generation: through SGLang's distributed update to its `server_ranks` ranks, or with
    `weights_dir`, by `/update_weights` from a checkpoint written there); processing_class:
    required (no hub). Other arguments are GRPOTrainer's; those tonp cannot honour raise
    ValueError (`check_args`). Sampling noise keys are distinct across steps and processes:
    (generation call * processes + process) * 2**32 + row.
    """

    def __init__(self, model, reward_funcs=None, args: Optional[GRPOConfig] = None,
                 train_dataset=None, eval_dataset=None, processing_class=None, *,
                 generator: Optional[str] = None, weights_dir: Optional[str] = None,
                 server_ranks: int = 1, max_batch_size: Optional[int] = None, callbacks=None,
                 optimizers=(None, None), reward_processing_classes=None, peft_config=None,
                 quantization_config=None, tools=None, rollout_func=None,
                 environment_factory=None):
        if args is None:
            raise ValueError("TonpGRPOTrainer: pass args (e.g. tonp_grpo_config(output_dir=...))")
        if processing_class is None:
            raise ValueError("TonpGRPOTrainer: pass processing_class (a tokenizer; no hub)")
        check_args(args, peft_config=peft_config, quantization_config=quantization_config,
                   tools=tools, rollout_func=rollout_func,
                   environment_factory=environment_factory)
        policy = model if isinstance(model, TonpPolicy) else TonpPolicy(model)
        # With beta > 0 TRL would load its reference model from the policy's hub id; tonp's is a
        # frozen copy of the initial policy, built below (TRL reads beta only at construction).
        beta, sync_ref = args.beta, args.sync_ref_model
        args.beta, args.sync_ref_model = 0.0, False
        try:
            super().__init__(policy, reward_funcs=reward_funcs, args=args,
                             train_dataset=train_dataset, eval_dataset=eval_dataset,
                             processing_class=processing_class,
                             reward_processing_classes=reward_processing_classes,
                             callbacks=callbacks, optimizers=optimizers)
        finally:
            args.beta, args.sync_ref_model = beta, sync_ref
        self.beta = beta
        if beta != 0.0:
            tonp_ref = copy.deepcopy(self.accelerator.unwrap_model(self.model).tonp)
            self.ref_model = TonpPolicy(tonp_ref.requires_grad_(False)).eval()
            if sync_ref:
                self.add_callback(SyncRefModelCallback(ref_model=self.ref_model,
                                                       accelerator=self.accelerator))
        # TRL's vLLM importance-sampling branches read this attribute (not args.use_vllm, which
        # would construct vLLM): with it set they compare the engine's sampling logprobs with
        # the scorer's, correct the loss with the ratio and log sampling/* metrics.
        self.use_vllm = True
        self._last_loaded_step = -1
        self._tonp_calls = 0
        tonp = self.accelerator.unwrap_model(self.model).tonp
        if generator is None:
            self.tonp_generator = InProcessGenerator(tonp, max_batch_size=max_batch_size)
        else:
            self.tonp_generator = ServerGenerator(
                generator, weights_dir, server_ranks=server_ranks,
                is_main=self.accelerator.is_main_process,
                share_version=self._share if self.accelerator.num_processes > 1 else None)
        self.add_callback(_CloseGenerator(self.tonp_generator))
        # TRL's vLLM client would fetch these; the engine needs them per call.
        self._tonp_top_k = self.top_k if self.top_k else None
        self._tonp_top_p = self.top_p if self.top_p < 1.0 else None

    def _share(self, version: Optional[int]) -> int:
        from accelerate.utils import broadcast_object_list
        box = [version]
        broadcast_object_list(box, from_process=0)
        return box[0]

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                              has_tool_images=False):
        if images is not None or multimodal_fields:
            raise ValueError("TonpGRPOTrainer: tonp's model is text-only (got images)")
        gen = self.tonp_generator
        if self.state.global_step != self._last_loaded_step:
            gen.sync(self.accelerator.unwrap_model(self.model).tonp, self.state.global_step)
            self._last_loaded_step = self.state.global_step
        acc = self.accelerator
        base = (self._tonp_calls * acc.num_processes + acc.process_index) * _STRIDE
        self._tonp_calls += 1
        return gen.generate(prompt_ids, [base + i for i in range(len(prompt_ids))],
                            max_new_tokens=self.max_completion_length,
                            temperature=self.temperature, top_k=self._tonp_top_k,
                            top_p=self._tonp_top_p, seed=self.args.seed,
                            eos_token_ids=self.eos_token_ids)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask,
                                           logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False,
                                           **multimodal):
        """TRL's padded batch [B, P + C] -> (logprobs [B, C], entropies [B, C] | None, None):
        each row's real tokens (attention_mask 1: the left-padded prompt and the right-padded
        completion) are scored as one packed sequence by `token_logprobs`; positions without a
        completion token hold 0."""
        if compute_aux_loss:
            raise ValueError("TonpGRPOTrainer: tonp returns no router aux loss")
        if any(v is not None for v in multimodal.values()):
            raise ValueError(f"TonpGRPOTrainer: multimodal inputs "
                             f"{sorted(k for k, v in multimodal.items() if v is not None)}")
        C = logits_to_keep
        mask = attention_mask.bool()
        seqs = [row[m].cpu() for row, m in zip(input_ids, mask)]
        starts = mask[:, :-C].sum(1).tolist() if input_ids.size(1) > C else [0] * len(seqs)
        if min(starts, default=1) < 1:
            raise ValueError("TonpGRPOTrainer: every prompt needs at least one token")
        lps, ents = model(seqs, self.temperature, entropy=compute_entropy,
                          micro_batch_size=batch_size)

        def completion(vals):   # the completion tokens' values, right-padded to C
            return torch.stack([F.pad(v[s - 1:], (0, C - (len(v) - s + 1)))
                                for v, s in zip(vals, starts)]).to(input_ids.device)
        return completion(lps), completion(ents) if compute_entropy else None, None

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        raise NotImplementedError("TonpGRPOTrainer: resume_from_checkpoint is not supported "
                                  "yet (the checkpoint holds tonp's HF layout; load it with "
                                  "Qwen3MoeForCausalLM.from_pretrained and start a new run)")


__all__ = ["TonpGRPOTrainer", "TonpPolicy", "check_args", "tonp_grpo_config"]
