"""The values each `ServerArgs` option takes, and the checks that reject a bad one or a bad
combination (`validate_server_args`, which `ServerArgs.validate` runs): every error is a
ValueError naming the option, so `sglite serve` and `Engine(**kwargs)` fail the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglite.runtime.server_args import ServerArgs

SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs")
DTYPES = ("auto", "float32", "bfloat16", "float16")
GRAMMAR_BACKENDS = ("llguidance", "xgrammar")
JUMP_FORWARD_MODES = ("exact", "retokenize")
SPECULATIVE_ALGORITHMS = ("ngram", "draft")
# SGLang names a separate draft model STANDALONE.
SPECULATIVE_ALIASES = {"standalone": "draft"}
# auto: the model file's own quantization (see `load_options.resolve_quantization`).
QUANTIZATIONS = ("auto", "none", "int8", "int4", "w4a8")
GEMM_PACKING = ("auto", "on", "off")
# How a GGUF's own blocks take activations (see `load_options.resolve_gguf_activations`).
GGUF_ACTIVATIONS = ("auto", "int8", "float")
DP_POLICIES = ("cache_aware", "round_robin", "least_load")
HICACHE_WRITE_POLICIES = ("write_through", "write_back")
HICACHE_LOAD_POLICIES = ("auto", "always", "never")
RADIX_EVICTION_POLICIES = ("lru", "benefit")
DISAGGREGATION_MODES = ("prefill", "decode")
TRANSFER_BACKENDS = ("auto", "tcp", "shm")
SEGMENT_SELECTIONS = ("once", "layerwise")


def _is_host_port(value: str) -> bool:
    host, _, port = value.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def validate_server_args(args: ServerArgs) -> None:
    """Raise ValueError naming the first bad argument of `args`; SGLang's alias of a
    speculative algorithm is replaced by sglite's name."""
    if args.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {args.dtype!r}")
    if not (args.device == "cpu" or args.device.startswith("cuda")):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {args.device!r}")
    if args.schedule_policy not in SCHEDULE_POLICIES:
        raise ValueError(
            f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {args.schedule_policy!r}"
        )
    if args.grammar_backend not in GRAMMAR_BACKENDS:
        raise ValueError(
            f"grammar_backend must be one of {GRAMMAR_BACKENDS}, got {args.grammar_backend!r}"
        )
    if args.jump_forward_mode not in JUMP_FORWARD_MODES:
        raise ValueError(
            f"jump_forward_mode must be one of {JUMP_FORWARD_MODES}, got {args.jump_forward_mode!r}"
        )
    if args.speculative_algorithm is not None:
        known = (*SPECULATIVE_ALGORITHMS, *SPECULATIVE_ALIASES)
        if args.speculative_algorithm.lower() not in known:
            raise ValueError(
                f"speculative_algorithm must be one of {known}, got {args.speculative_algorithm!r}"
            )
        algorithm = args.speculative_algorithm.lower()
        args.speculative_algorithm = SPECULATIVE_ALIASES.get(algorithm, algorithm)
    _check_draft_model(args)
    _check_disaggregation(args)
    if args.segment_selection not in SEGMENT_SELECTIONS:
        raise ValueError(
            f"segment_selection must be one of {SEGMENT_SELECTIONS}, got {args.segment_selection!r}"
        )
    if not 0.0 <= args.segment_recompute_fraction <= 1.0:
        raise ValueError(
            f"segment_recompute_fraction must be in [0, 1], got {args.segment_recompute_fraction}"
        )
    _check_deterministic(args)
    if not 1 <= args.speculative_num_draft_tokens <= 64:
        raise ValueError(
            "speculative_num_draft_tokens must be in 1..64, "
            f"got {args.speculative_num_draft_tokens}"
        )
    if args.speculative_draft_vocab_size < 0:
        raise ValueError(
            "speculative_draft_vocab_size must be 0 (the whole vocabulary) or more, "
            f"got {args.speculative_draft_vocab_size}"
        )
    low = args.speculative_ngram_min_match_window_size
    high = args.speculative_ngram_max_match_window_size
    if not 1 <= low <= high:
        raise ValueError(
            "speculative_ngram_min_match_window_size and speculative_ngram_max_match_window_"
            f"size must satisfy 1 <= min <= max, got {low} and {high}"
        )
    if args.tool_call_parser is not None:
        from sglite.runtime.tool_calls.formats import get_format

        get_format(args.tool_call_parser)  # ValueError naming the choices
    if args.max_stored_responses < 1:
        raise ValueError(f"max_stored_responses must be >= 1, got {args.max_stored_responses}")
    if args.pooling not in ("last", "mean"):
        raise ValueError(f"pooling must be last or mean, got {args.pooling!r}")
    if args.reasoning_parser is not None:
        from sglite.runtime.reasoning import get_reasoning_format

        get_reasoning_format(args.reasoning_parser)
    if args.quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {args.quantization!r}")
    if args.gguf_activations not in GGUF_ACTIVATIONS:
        raise ValueError(
            f"gguf_activations must be one of {GGUF_ACTIVATIONS}, got {args.gguf_activations!r}"
        )
    if args.quantization not in ("auto", "none") and args.device != "cpu":
        raise ValueError("quantization uses PyTorch's CPU kernels; it needs device='cpu'")
    for name in ("tp_size", "dp_size", "nnodes"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"node_rank must be in 0..{args.nnodes - 1}, got {args.node_rank}")
    if args.tp_size % args.nnodes:
        raise ValueError(f"tp_size ({args.tp_size}) must be a multiple of nnodes")
    if args.nnodes > 1 and not args.dist_init_addr:
        raise ValueError("multi-node tensor parallelism needs --dist-init-addr HOST:PORT")
    if args.nnodes > 1 and args.dp_size > 1:
        raise ValueError("dp_size > 1 is supported on one node only")
    if args.dp_policy not in DP_POLICIES:
        raise ValueError(f"dp_policy must be one of {DP_POLICIES}, got {args.dp_policy!r}")
    if args.dist_init_addr is not None and not _is_host_port(args.dist_init_addr):
        raise ValueError(f"dist_init_addr must be HOST:PORT, got {args.dist_init_addr!r}")
    if args.gemm_packing not in GEMM_PACKING:
        raise ValueError(f"gemm_packing must be one of {GEMM_PACKING}, got {args.gemm_packing!r}")
    if args.quantized_max_rows is not None and args.quantized_max_rows < -1:
        raise ValueError(f"quantized_max_rows must be >= -1, got {args.quantized_max_rows}")
    if args.grammar_compile_timeout <= 0:
        raise ValueError("grammar_compile_timeout must be positive")
    for name in ("max_running_requests", "chunked_prefill_size", "max_prefill_tokens"):
        if getattr(args, name) <= 0:
            raise ValueError(f"{name} must be positive, got {getattr(args, name)}")
    if args.max_total_tokens is not None and args.max_total_tokens < 16:
        raise ValueError(f"max_total_tokens must be >= 16, got {args.max_total_tokens}")
    for name in ("max_n", "max_request_body_bytes"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(args, name)}")
    for name in ("max_new_tokens_limit", "request_timeout"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if args.graceful_shutdown_timeout < 0:
        raise ValueError("graceful_shutdown_timeout must be >= 0")
    if args.default_max_tokens < 0:
        raise ValueError(f"default_max_tokens must be >= 0, got {args.default_max_tokens}")
    _check_hicache(args)
    if args.context_length is not None and args.context_length <= 1:
        raise ValueError(f"context_length must be > 1, got {args.context_length}")


def _check_deterministic(args: ServerArgs) -> None:
    if not args.enable_deterministic_inference:
        return
    if args.device != "cpu":
        raise ValueError("enable_deterministic_inference needs device='cpu' (native kernels)")
    if args.tp_size > 1:
        raise ValueError("enable_deterministic_inference is not supported with tp_size > 1")
    if args.quantization == "w4a8":
        raise ValueError(
            "enable_deterministic_inference: quantization 'w4a8' rounds activations per "
            "batch of rows; use int4"
        )
    if args.quantized_max_rows not in (None, -1):
        raise ValueError(
            "enable_deterministic_inference uses one weight for every batch size: "
            "quantized_max_rows must be unset or -1"
        )


def _check_draft_model(args: ServerArgs) -> None:
    draft = args.speculative_algorithm == "draft"
    if draft and not args.speculative_draft_model_path:
        raise ValueError("speculative_algorithm='draft' needs speculative_draft_model_path")
    if not draft and args.speculative_draft_model_path is not None:
        raise ValueError(
            "speculative_draft_model_path is used with speculative_algorithm='draft' only"
        )
    if draft and args.tp_size > 1:
        # The draft model runs on rank 0 alone; it is not sharded.
        raise ValueError("speculative_algorithm='draft' is not supported with tp_size > 1")
    if args.speculative_draft_model_quantization not in QUANTIZATIONS:
        raise ValueError(
            f"speculative_draft_model_quantization must be one of {QUANTIZATIONS}, "
            f"got {args.speculative_draft_model_quantization!r}"
        )
    layers = args.speculative_draft_num_layers
    if layers is not None and layers < 1:
        raise ValueError(f"speculative_draft_num_layers must be >= 1, got {layers}")


def _check_disaggregation(args: ServerArgs) -> None:
    mode = args.disaggregation_mode
    if mode is not None and mode not in DISAGGREGATION_MODES:
        raise ValueError(f"disaggregation_mode must be one of {DISAGGREGATION_MODES}, got {mode!r}")
    if args.disaggregation_transfer_backend not in TRANSFER_BACKENDS:
        raise ValueError(
            f"disaggregation_transfer_backend must be one of {TRANSFER_BACKENDS}, "
            f"got {args.disaggregation_transfer_backend!r}"
        )
    if not 1 <= args.disaggregation_bootstrap_port <= 65535:
        raise ValueError(
            "disaggregation_bootstrap_port must be in [1, 65535], "
            f"got {args.disaggregation_bootstrap_port}"
        )
    if args.disaggregation_transfer_timeout <= 0:
        raise ValueError("disaggregation_transfer_timeout must be > 0")
    if mode is not None and (args.tp_size > 1 or args.dp_size > 1):
        # One scheduler process per server owns the bootstrap socket and the whole pool.
        raise ValueError("disaggregation_mode is supported with tp_size 1 and dp_size 1 only")


def _check_hicache(args: ServerArgs) -> None:
    for name, choices in (
        ("hicache_write_policy", HICACHE_WRITE_POLICIES),
        ("hicache_load_policy", HICACHE_LOAD_POLICIES),
        ("radix_eviction_policy", RADIX_EVICTION_POLICIES),
    ):
        if getattr(args, name) not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {getattr(args, name)!r}")
    if not args.hicache_size >= 0:  # also rejects NaN
        raise ValueError(f"hicache_size must be >= 0 (GB), got {args.hicache_size}")
    if args.hicache_page_size < 1:
        raise ValueError(f"hicache_page_size must be >= 1, got {args.hicache_page_size}")
    if args.min_cached_prefix < 0:
        raise ValueError(f"min_cached_prefix must be >= 0, got {args.min_cached_prefix}")
    if args.hicache_quantize and args.hicache_size <= 0:
        raise ValueError("hicache_quantize needs a host tier (hicache_size > 0)")
    if args.hicache_dir is not None and not args.hicache_dir:
        raise ValueError("hicache_dir must be a directory path, got an empty string")
    tiered = args.hicache_size > 0 or args.hicache_dir is not None
    if tiered and args.tp_size > 1:
        # Promotion copies a host/disk span into rank 0's pool only; the other ranks' shards
        # of that span would be missing.
        raise ValueError("hicache_size / hicache_dir are not supported with tp_size > 1")
    if args.disable_radix_cache and (tiered or args.radix_eviction_policy != "lru"):
        raise ValueError("hicache_size / hicache_dir / radix_eviction_policy need the radix "
                         "cache; drop disable_radix_cache")  # fmt: skip
