"""The rollout engine: a request queue and a scheduler (continuous batching, prefix caching,
chunked prefill) over one model and one paged KV cache. `tonp_models.generate` is a client of
it, and so is the HTTP service `tonp_models.serve`; every entry point makes its requests by the
rules of engine/rules.py. See docs/generation.md."""
from . import rules
from .engine import Engine, lockstep_group
from .prefix_cache import PrefixCache, page_key
from .request import EngineStats, Request, SamplingParams, StepOutput
from .scheduler import Scheduler

__all__ = ["Engine", "EngineStats", "PrefixCache", "Request", "SamplingParams", "Scheduler",
           "StepOutput", "lockstep_group", "page_key", "rules"]
