"""tonp_models.serve: the rollout service. An OpenAI-compatible HTTP server in vLLM's dialect
(completions, chat completions, prompt logprobs, stop strings), SGLang's token-id /generate,
/metrics and /update_weights over the rollout engine,
and `RolloutClient`, a small client an RL loop rolls out and updates weights with.

    python -m tonp_models.serve --hf PATH --port 8000           # see docs/serving.md

Modules: service.py (the engine thread, lockstep over ranks, weight updates), app.py (the app:
lifespan, errors, routers), calls.py (the prompt -> engine-request builder and a call's
outputs), common_api.py / openai_api.py / sglang_api.py / weights_api.py (the handlers of each
dialect), protocol.py (request bodies and their checks), formats.py (response bodies, metrics),
text.py (tokenizer and chat template), client.py (RolloutClient).
"""
from .client import RolloutClient

__all__ = ["RolloutClient"]
