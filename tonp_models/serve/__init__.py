"""tonp_models.serve: the rollout service. An OpenAI-compatible HTTP server in vLLM's dialect
(completions, chat completions, prompt logprobs, stop strings), SGLang's token-id /generate,
/metrics and weight updates (from disk or a trainer's process group) over the rollout engine,
and `RolloutClient`, a small client an RL loop rolls out and updates weights with.

    python -m tonp_models.serve --hf PATH --port 8000           # see docs/serving.md

Modules: cli.py (the command line), service.py (the engine thread, lockstep over ranks, weight
updates), app.py (the app: lifespan, errors, routers), security.py (the guard in front of every
route), calls.py (the prompt -> engine-request builder and a call's outputs), the handlers of
each dialect: common_api.py (health, models, metrics, vLLM's info routes), openai_api.py,
sglang_api.py and weights_api.py; protocol.py (the OpenAI-style request bodies and their checks),
sglang_protocol.py (SGLang's /generate body and result), formats.py (response bodies, metrics),
weight_sync.py (weights from a trainer's process group, both sides), text.py (tokenizer and chat
template), client.py (RolloutClient).
"""
from .client import RolloutClient, ServedOutput

__all__ = ["RolloutClient", "ServedOutput"]
