"""The command line of the rollout service, `python -m tonp_models.serve` (docs/serving.md).

    python -m tonp_models.serve --hf PATH                       # an HF checkpoint directory
    python -m tonp_models.serve --preset tiny --port 8000       # a random tiny model
    torchrun --nproc-per-node 2 -m tonp_models.serve --hf PATH --tp 2

Rank 0 serves HTTP (host 127.0.0.1 unless --host says otherwise; --port 0 picks a free port);
every rank steps the engine in lockstep. The line "tonp serve: listening on http://HOST:PORT"
is printed (and flushed) once the server accepts connections. SIGINT / SIGTERM shut it down
gracefully: running requests finish (up to --graceful-timeout seconds), the rest are cancelled.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
from typing import List, Optional

import torch


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tonp_models.serve",
                                 description="tonp's OpenAI-compatible rollout service")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", metavar="PATH", help="an HF checkpoint directory (config.json, "
                     "safetensors, and optionally a tokenizer with a chat template)")
    src.add_argument("--preset", help="a Qwen3MoeConfig preset with random weights (e.g. tiny)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", type=key_value,
                    help="override a preset config field (value parsed as JSON when it is)")
    ap.add_argument("--seed", type=int, default=0, help="weight init seed of --preset")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default=None,
                    help="default: the checkpoint's (fp32 for --preset)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (torchrun)")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel degree (torchrun)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0 = a free port")
    ap.add_argument("--served-model-name", default=None, help="default: the directory name")
    ap.add_argument("--max-batch-size", type=int, default=32, help="requests running at once")
    ap.add_argument("--num-pages", type=int, default=None,
                    help="KV-cache pages (default: max-batch-size full-length sequences)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="prompt + max tokens at most (default: max_position_embeddings)")
    ap.add_argument("--max-step-tokens", type=int, default=None,
                    help="tokens a forward feeds at most (chunked prefill; default: no limit)")
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--no-weight-groups", action="store_true",
                    help="keep no second copy of the expert and fp32 dense weights in column "
                         "groups (the CPU tiles' faster reads in decode; the same bits)")
    ap.add_argument("--max-n", type=int, default=64, help="sequences one request may ask for")
    ap.add_argument("--max-logprobs", type=int, default=20,
                    help="top (and prompt) logprobs a request may ask for (-1 = the vocab)")
    ap.add_argument("--max-prompt-chars", type=int, default=None,
                    help="characters of a text prompt, checked before tokenizing "
                         "(default: 32 x max-model-len)")
    ap.add_argument("--mode", choices=["invariant", "torch"], default="invariant",
                    help="kernel mode (torch: stock ops, for comparison)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank")
    ap.add_argument("--allowed-weights-dir", default=None, metavar="DIR",
                    help="/update_weights loads only checkpoints below DIR (symlinks resolved; "
                    "default: the --hf directory; none for --preset)")
    ap.add_argument("--weight-sync-timeout", type=float, default=120.0, metavar="S",
                    help="the longest a weight-update group's rendezvous or one pushed "
                    "tensor may take (/init_weights_update_group)")
    ap.add_argument("--graceful-timeout", type=float, default=10.0,
                    help="seconds running requests may take to finish on shutdown")
    ap.add_argument("--api-key", action="append", default=None, metavar="KEY",
                    help="require 'Authorization: Bearer KEY' on every route but /health "
                    "(repeat for several keys; default: the env TONP_API_KEY, else none)")
    ap.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                    help="a host name the Host / Origin headers may name besides localhost, "
                    "127.0.0.1 and [::1] (e.g. a proxy's; '*': any)")
    ap.add_argument("--allowed-master-address", action="append", default=[], metavar="ADDR",
                    help="an address /init_weights_update_group's master_address may name on a "
                    "loopback bind besides loopback ones and --allowed-host names (every "
                    "server rank connects there; '*': any)")
    ap.add_argument("--max-body-bytes", type=int, default=None,
                    help="the largest request body (default: max(4 MiB, 64 x max-model-len))")
    args = ap.parse_args(argv)
    if args.api_key is None and os.environ.get("TONP_API_KEY") is not None:
        args.api_key = [os.environ["TONP_API_KEY"]]
    if any(not k.strip() for k in args.api_key or []):
        ap.error("--api-key / TONP_API_KEY: an empty key would let everyone in")
    if args.max_body_bytes is not None and args.max_body_bytes < 1:
        ap.error(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    return args


def key_value(item: str):
    """An argparse type: "KEY=VALUE" -> (key, value parsed as JSON when it is JSON)."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {item!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def build_model(args, groups):
    from tonp_models import Qwen3MoeConfig, Qwen3MoeForCausalLM
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, None: None}[args.dtype]
    if args.hf:
        return Qwen3MoeForCausalLM.from_pretrained(args.hf, dtype=dtype, groups=groups).eval()
    config = Qwen3MoeConfig.preset(args.preset, **dict(args.set))
    torch.manual_seed(args.seed)
    return Qwen3MoeForCausalLM(config, dtype=dtype or torch.float32, groups=groups).eval()


def weights_dir(args) -> Optional[str]:
    """The directory disk updates may come from (resolved), or None (disk updates refused)."""
    d = args.allowed_weights_dir or args.hf
    return os.path.realpath(d) if d else None


def weights_path_check(allowed: Optional[str]):
    """path -> the resolved checkpoint dir to load, on the HTTP thread before the update
    queues; WeightsRefused (403 outside `allowed`, 400 not a checkpoint directory)."""
    from .service import WeightsRefused

    def check(path: str) -> str:
        if allowed is None:
            raise WeightsRefused("update_weights: disk updates are off (the server was started "
                                 "from a preset): start it with --allowed-weights-dir DIR", None,
                                 403)
        real = os.path.realpath(path)
        if os.path.commonpath([real, allowed]) != allowed:
            raise WeightsRefused(f"update_weights: {path} is outside the directory this server "
                                 f"loads weights from (--allowed-weights-dir)", None, 403)
        if not os.path.isdir(real):
            raise WeightsRefused(f"update_weights: {path} is not a checkpoint directory")
        names = os.listdir(real)
        if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
            raise WeightsRefused(f"update_weights: {path} holds no config.json and "
                                 f"*.safetensors (not an HF checkpoint directory)")
        return real
    return check


def weight_loader(model):
    """path -> load that checkpoint into `model` (this rank's shards); WeightsRefused, before
    any weight changes, when the directory, its files or its config do not fit the model.
    Messages name the path and the problem, never what the files hold (that goes to `detail`,
    the server log)."""
    import dataclasses

    from tonp_models import Qwen3MoeConfig
    from tonp_models.qwen3_moe.checkpoint import (CheckpointMismatch, check_checkpoint,
                                                  copy_checkpoint)

    from .service import WeightsRefused

    def load(path: str) -> None:
        try:
            config = Qwen3MoeConfig.from_hf(path)
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise WeightsRefused(f"update_weights: cannot read a checkpoint config at {path!r} "
                                 f"(missing, or not a Qwen3-MoE config.json)", str(e)) from None
        mine = dataclasses.asdict(model.config)
        differ = sorted(k for k, v in dataclasses.asdict(config).items()
                        if k != "torch_dtype" and mine[k] != v)
        if differ:
            raise WeightsRefused(f"update_weights: the checkpoint at {path!r} does not match "
                                 f"the running model: {', '.join(differ)} differ")
        try:
            plan = check_checkpoint(model, path)
        except CheckpointMismatch as e:
            counts = ", ".join(f"{len(v)} {k}" for k, v in e.problems.items() if v)
            raise WeightsRefused(f"update_weights: the checkpoint at {path!r} does not match "
                                 f"the running model's tensors ({counts}; the server log "
                                 f"names them)", str(e)) from None
        except (OSError, ValueError) as e:
            raise WeightsRefused(f"update_weights: the safetensors files at {path!r} cannot be "
                                 f"read (unreadable, truncated, or ambiguous)", str(e)) from None
        copy_checkpoint(model, plan)
    return load


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    import tonp_parallel as tpar

    if args.threads:
        torch.set_num_threads(args.threads)
    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    groups = tpar.init_parallel(tp=args.tp, ep=args.ep) if distributed or args.tp * args.ep > 1 \
        else None
    try:
        _serve_ranks(args, groups)
    finally:  # every rank's loop has ended: gloo's threads and rank 0's store stop here, not in
        if groups is not None:  # the interpreter's teardown (a rank aborted there at exit)
            groups = None
            tpar.destroy_parallel()


def _serve_ranks(args, groups) -> None:
    """Rank 0 serves HTTP; other ranks follow its broadcast ticks (tp x ep ranks, one model)."""
    from tonp_models.engine import Engine

    from .app import ServeState
    from .security import Security, default_body_limit
    from .service import EngineService
    from .text import TextCodec
    from .weight_sync import WeightReceiver

    if groups is not None and groups.world_size > args.tp * args.ep:
        raise SystemExit(f"tonp_models.serve: {groups.world_size} ranks for tp={args.tp} x "
                         f"ep={args.ep}: the world must be one model; data-parallel replicas "
                         f"are separate servers")
    model = build_model(args, groups)
    c = model.config
    context = min(args.max_model_len or c.max_position_embeddings, c.max_position_embeddings)
    engine = Engine(model, max_batch_size=args.max_batch_size, num_pages=args.num_pages,
                    max_seq_len=context - 1, prefix_caching=not args.no_prefix_cache,
                    max_step_tokens=args.max_step_tokens, who="serve",
                    weight_groups=not args.no_weight_groups)
    group = None if groups is None else torch.distributed.group.WORLD
    service = EngineService(engine, weight_loader(model),
                            check_weights=weights_path_check(weights_dir(args)),
                            sync=WeightReceiver(model, group, args.weight_sync_timeout),
                            mode=args.mode, group=group)
    if groups is not None and groups.rank != 0:
        service.follow()
        return
    codec = TextCodec(args.hf)
    eos = c.eos_token_id if isinstance(c.eos_token_id, list) else \
        [] if c.eos_token_id is None else [c.eos_token_id]
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.hf)) if args.hf
                                      else args.preset)
    st = ServeState(service, codec, name, context, c.vocab_size,
                    sorted(set(eos) | set(codec.eos_ids())), args.max_n,
                    c.vocab_size if args.max_logprobs == -1 else args.max_logprobs,
                    args.max_prompt_chars)
    st.security = Security.for_server(args.host, api_keys=args.api_key or (),
                                      allowed_hosts=args.allowed_host,
                                      master_addresses=args.allowed_master_address,
                                      max_body_bytes=args.max_body_bytes or
                                      default_body_limit(context))
    serve(st, args.host, args.port, args.graceful_timeout)


def serve(st, host: str, port: int, graceful_timeout: float) -> None:
    """Bind, start the engine thread, announce the address once serving, serve until a signal."""
    import uvicorn

    from .app import create_app
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)      # connections wait in the backlog until uvicorn accepts them
    bound = sock.getsockname()
    st.service.start()
    holder = []   # the server, once built: the app watches it for the shutdown signal
    app = create_app(st, ready=f"tonp serve: listening on http://{bound[0]}:{bound[1]}",
                     stopping=lambda: bool(holder) and holder[0].should_exit,
                     grace=graceful_timeout)
    # uvicorn's own deadline is a backstop: the app aborts what is left after the grace period
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=graceful_timeout + 10))
    holder.append(server)
    # uvicorn shuts down gracefully on SIGINT / SIGTERM, then re-raises the signal to the
    # handler it found: with these, the process then ends normally (exit code 0).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        st.service.shutdown()
        sys.stdout.flush()
