"""The rollout engine: a request queue and a scheduler (continuous batching, prefix caching,
chunked prefill) over one model and one paged KV cache, whose pages the scheduler allocates
(engine/pages.py). `tonp_models.generate` is a client of
it, and so is the HTTP service `tonp_models.serve`; every entry point makes its requests by the
rules of engine/rules.py. See docs/generation.md."""
from . import rules
from .engine import Engine, lockstep_group
from .pages import PageAllocator, extend
from .prefix_cache import PrefixCache, page_key
from .request import EngineStats, Request, SamplingParams, StepOutput
from .scheduler import ScheduledBatch, Scheduler

__all__ = ["Engine", "EngineStats", "PageAllocator", "PrefixCache", "Request", "SamplingParams",
           "ScheduledBatch", "Scheduler", "StepOutput", "extend", "lockstep_group", "page_key",
           "rules"]
