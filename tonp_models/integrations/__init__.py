"""Adapters that put tonp's model and engine inside the RL frameworks users run.

    from tonp_models.integrations.trl import TonpGRPOTrainer     # TRL's GRPOTrainer (docs/trl.md)

trl        TonpGRPOTrainer / TonpPolicy: TRL's GRPO loop on tonp's scorer and generator
rollout    where rollouts come from: the engine in process, or a tonp server (weights pushed)
tokenizer  a byte-level Hugging Face tokenizer built locally (the tiny preset's vocabulary)

Each adapter imports its framework only in its own module, so importing this package costs
nothing. Imports point downward: adapters use the model, the engine, the server client and the
training helpers; nothing in tonp imports an adapter.
"""
