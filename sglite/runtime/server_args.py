"""One dataclass of arguments shared by the CLI (`sglite serve`) and `sglite.Engine(**kwargs)`.

Every server flag `--foo-bar` is the keyword `foo_bar=` of the Engine, so a setting means the same
thing on both paths.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs")
DTYPES = ("auto", "float32", "bfloat16", "float16")
GRAMMAR_BACKENDS = ("llguidance", "xgrammar")
JUMP_FORWARD_MODES = ("exact", "retokenize")
SPECULATIVE_ALGORITHMS = ("ngram", "draft")
# SGLang names a separate draft model STANDALONE.
SPECULATIVE_ALIASES = {"standalone": "draft"}
# auto: the model file's own quantization (see `loader.resolve_quantization`).
QUANTIZATIONS = ("auto", "none", "int8", "int4", "w4a8")
GEMM_PACKING = ("auto", "on", "off")
# How a GGUF's own blocks take activations (see `loader.resolve_gguf_activations`).
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


@dataclass
class ServerArgs:
    """Arguments of one engine/server. Invariant: `validate()` has passed before use."""

    model_path: str | None = None  # None = the default model (SmolLM2-135M-Instruct GGUF)
    tokenizer_path: str | None = None
    dtype: str = "auto"  # auto = bfloat16 where the CPU has native bf16, else float32
    device: str = "cpu"
    context_length: int | None = None  # None = the model's own max positions
    # Memory: the KV token pool holds this many tokens (all layers). None = sized from the model.
    max_total_tokens: int | None = None
    max_running_requests: int = 64
    max_queued_requests: int = 1024
    # A prefill batch takes at most min(chunked_prefill_size, max_prefill_tokens) new tokens over
    # all its requests; a longer prompt is prefilled in chunks of that many.
    chunked_prefill_size: int = 1024
    max_prefill_tokens: int = 4096
    schedule_policy: str = "lpm"
    # A request that has waited this long (seconds) is admitted next whatever the policy says.
    starvation_timeout: float = 10.0
    disable_radix_cache: bool = False
    # Hierarchical cache (docs/hicache.md): a host tier of this many GB (10^9 bytes; 0 = none),
    # optionally int8 (lossy), and a disk tier of page files under `hicache_dir` that survives
    # restarts. write_through copies spans down at insert, write_back when evicted.
    hicache_size: float = 0.0
    hicache_quantize: bool = False
    hicache_dir: str | None = None
    hicache_page_size: int = 32  # tokens per disk page
    hicache_write_policy: str = "write_through"
    # auto: load a span from a tier only when that is cheaper than recomputing it.
    hicache_load_policy: str = "auto"
    # Adaptive caching: eviction order (lru, or benefit = hits x cost to restore) and the
    # shortest sequence worth caching (shorter ones are not inserted).
    radix_eviction_policy: str = "lru"
    min_cached_prefix: int = 0
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.002
    random_seed: int = 0
    # Constrained decoding (regex / JSON schema / EBNF).
    grammar_backend: str = "llguidance"
    grammar_compile_timeout: float = 10.0  # seconds; a slower compile fails the request
    disable_jump_forward: bool = False
    # exact: forced tokens are a draft the model verifies (outputs unchanged); retokenize:
    # SGLang's original jump-forward, forced text appended unverified (faster, outputs drift).
    jump_forward_mode: str = "exact"
    # Speculative decoding (scheduler/speculation.py), verified in the next forward (outputs
    # unchanged); None = off. "ngram" drafts from the request's own text: at most
    # `speculative_num_draft_tokens` tokens continuing the latest earlier match of the request's
    # last n tokens, n from the max down to the min match window. "draft" drafts with a second
    # model of the same tokenizer (`speculative_draft_model_path`; the target's own file with
    # `speculative_draft_num_layers` and/or a cheaper quantization is self-speculation).
    speculative_algorithm: str | None = None
    # 15: with the request's pending token, a whole draft fills one 16-row tile of the tile GEMM
    # (a 17th row would start a tile of its own, costing half a full one for one more token).
    speculative_num_draft_tokens: int = 15
    speculative_ngram_min_match_window_size: int = 2
    speculative_ngram_max_match_window_size: int = 12
    speculative_draft_model_path: str | None = None
    speculative_draft_model_quantization: str = "auto"
    speculative_draft_num_layers: int | None = None
    # The draft model chooses its tokens among the head's first N rows (a BPE's most frequent
    # tokens), the added tokens and the prompt's own (scheduler/draft_vocabulary.py); 0: all.
    speculative_draft_vocab_size: int = 32768
    # With a draft model, drafts copied from text already seen (the n-gram proposer, free) come
    # first where there is a match; the draft model drafts where there is none.
    speculative_draft_ngram: bool = True
    # Deterministic inference (docs/deterministic.md): a request's logits are bitwise the same
    # whatever its batch, cached prefix, prefill chunking, jump-forward or speculation and thread
    # count: every forward runs as rows through the native decode step with one kernel per
    # weight for every row count. Quantized projections are then used for every batch size.
    enable_deterministic_inference: bool = False
    # Drafting pauses below the measured break-even acceptance (scheduler/speculation.py's
    # `SpeculationCosts`); False = below the fixed LOW_ACCEPTANCE.
    speculative_adaptive: bool = True
    # Compute threads per scheduler process; None = this machine's cores shared evenly among
    # the scheduler processes it runs (tp ranks x dp replicas).
    num_threads: int | None = None
    # Parallelism: tensor parallel ranks (one scheduler process each, torch.distributed), data
    # parallel replicas behind one front, and multi-node tensor parallelism (SGLang's flags).
    tp_size: int = 1
    dp_size: int = 1
    dp_policy: str = "cache_aware"
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # HOST:PORT of rank 0's rendezvous; None = local port
    # Quantization of the projections (CPU): int8 / int4 weight-only; w4a8 = int4 whose decode
    # GEMVs also round activations to int8 (fastest; answers then depend on batch and cache);
    # auto (default) = a GGUF's own (int4 for 4-bit projections, int8 for 5-8-bit ones, else
    # none; dense on CUDA): the default model runs int4, lossless; none = dense. Matmuls of at
    # most `quantized_max_rows` rows use it, larger ones a dense copy; -1 = always quantized, no
    # dense copy (the memory a quantized model should take); None = auto (-1 in float32 with
    # the native kernels, whose quantized GEMM serves every batch size; else 8).
    quantization: str = "auto"
    quantized_max_rows: int | None = None
    # GGUF blocks (quantization auto): int8 rounds the activations of DECODE batches per row,
    # as llama.cpp does (integer dot products: the fastest decode), while prefill keeps them
    # for the float GEMMs; float keeps them everywhere; auto = int8 where the kernels have
    # integer dot products (x86 with AVX2 or AVX-512), else float.
    gguf_activations: str = "auto"
    # GGUF blocks (quantization auto) are read into the process's own memory at load (huge
    # pages where the kernel offers them: faster decode, `model/weight_arena.py`); with
    # mmap_weights they stay views of the file's mapping, whose pages processes serving the
    # same file share (data-parallel replicas) and which load lazily.
    mmap_weights: bool = False
    # GEMM-friendly copies of the dense weights (float32: panels for the native GEMM; bf16:
    # oneDNN-packed and transposed), faster for batches and prefill at the cost of one or two
    # more copies of the weights in memory: auto = for models up to 1 GiB.
    gemm_packing: str = "auto"
    log_level: str = "warning"
    # Limits on what one request may ask for (past them: HTTP 400 / ValueError).
    max_n: int = 64  # most choices (`n`) per request
    max_new_tokens_limit: int | None = None  # cap on max_new_tokens; None = the context length
    # New tokens a chat or Responses request gets when it sets no budget (at most the rest of
    # the context); 0 = the rest of the context, as OpenAI's API does.
    default_max_tokens: int = 4096
    request_timeout: float | None = None  # seconds; a longer request ends with an error
    # Vision-language models: most images per request, and whether http(s) image URLs are
    # fetched (off: only data: URLs, base64 and local files are read).
    max_images_per_request: int = 8
    allow_remote_images: bool = False
    vision_cache_images: int = 32  # images whose vision features are kept (0: none)
    # Server-only settings (`SERVER_ONLY`: the in-process Engine refuses them).
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None
    # Answer requests naming another model with 404 model_not_found (by default any name is
    # served by the one model, as SGLang does).
    strict_model_name: bool = False
    # How tool calls are parsed out of chat answers (None: the chat template's format).
    tool_call_parser: str | None = None
    # `tool_choice="auto"`: an answer that is exactly one plain JSON call object of a declared
    # tool, its arguments valid, is returned as that call (`tool_calls/lenient.py`) unless set.
    disable_lenient_tool_calls: bool = False
    # How a thinking model's reasoning is separated from its answer (None: it is not).
    reasoning_parser: str | None = None
    # How embeddings pool the prompt's final hidden states: the last token's, or their mean.
    pooling: str = "last"
    # Responses API: how many stored responses (`previous_response_id`) are kept.
    max_stored_responses: int = 1024
    max_request_body_bytes: int = 16 * 1024 * 1024  # larger bodies get HTTP 413
    allow_origins: str | None = None  # CORS, comma-separated origins or "*"; None = off
    # The page at `/` (chat playground, radix cache view, metrics); True turns it off.
    disable_web_ui: bool = False
    # Reusable prompt segments (scheduler/segments.py): the share of reused segment tokens
    # recomputed with full attention (those whose K/V deviate most); 1.0 = exact.
    segment_recompute_fraction: float = 0.25
    # How they are chosen (scheduler/segment_selection.py): "once", after layer 1, or
    # "layerwise", narrowed again after every layer at the same average cost.
    segment_selection: str = "once"
    # Disaggregated prefill and decode (docs/pd.md): "prefill" computes prompts and hands their
    # KV to a decode server; "decode" receives that KV and generates; None = both here. The
    # prefill server answers KV requests on the bootstrap port; pages travel over TCP, or shared
    # memory when both servers are on one host (auto: when the bootstrap host is loopback).
    disaggregation_mode: str | None = None
    disaggregation_bootstrap_port: int = 8998
    disaggregation_transfer_backend: str = "auto"
    # Seconds a request may wait with no KV page arriving (decode), or for its decode server
    # to ask for its pages (prefill), before it ends with an error and its pages are freed.
    disaggregation_transfer_timeout: float = 60.0
    # On SIGTERM, let requests in flight finish for this many seconds, then abort the rest.
    graceful_shutdown_timeout: float = 30.0
    # When the scheduler process dies: start a new one (True) or exit non-zero (False).
    restart_on_failure: bool = False

    def validate(self) -> None:
        """Raise ValueError naming the first bad argument."""
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}"
            )
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            raise ValueError(
                f"grammar_backend must be one of {GRAMMAR_BACKENDS}, got {self.grammar_backend!r}"
            )
        if self.jump_forward_mode not in JUMP_FORWARD_MODES:
            raise ValueError(
                f"jump_forward_mode must be one of {JUMP_FORWARD_MODES}, "
                f"got {self.jump_forward_mode!r}"
            )
        if self.speculative_algorithm is not None:
            known = (*SPECULATIVE_ALGORITHMS, *SPECULATIVE_ALIASES)
            if self.speculative_algorithm.lower() not in known:
                raise ValueError(
                    f"speculative_algorithm must be one of {known}, "
                    f"got {self.speculative_algorithm!r}"
                )
            algorithm = self.speculative_algorithm.lower()
            self.speculative_algorithm = SPECULATIVE_ALIASES.get(algorithm, algorithm)
        self._validate_draft_model()
        self._validate_disaggregation()
        if self.segment_selection not in SEGMENT_SELECTIONS:
            raise ValueError(
                f"segment_selection must be one of {SEGMENT_SELECTIONS}, "
                f"got {self.segment_selection!r}"
            )
        if not 0.0 <= self.segment_recompute_fraction <= 1.0:
            raise ValueError(
                "segment_recompute_fraction must be in [0, 1], "
                f"got {self.segment_recompute_fraction}"
            )
        self._validate_deterministic()
        if not 1 <= self.speculative_num_draft_tokens <= 64:
            raise ValueError(
                "speculative_num_draft_tokens must be in 1..64, "
                f"got {self.speculative_num_draft_tokens}"
            )
        if self.speculative_draft_vocab_size < 0:
            raise ValueError(
                "speculative_draft_vocab_size must be 0 (the whole vocabulary) or more, "
                f"got {self.speculative_draft_vocab_size}"
            )
        low = self.speculative_ngram_min_match_window_size
        high = self.speculative_ngram_max_match_window_size
        if not 1 <= low <= high:
            raise ValueError(
                "speculative_ngram_min_match_window_size and speculative_ngram_max_match_window_"
                f"size must satisfy 1 <= min <= max, got {low} and {high}"
            )
        if self.tool_call_parser is not None:
            from sglite.runtime.tool_calls.formats import get_format

            get_format(self.tool_call_parser)  # ValueError naming the choices
        if self.max_stored_responses < 1:
            raise ValueError(f"max_stored_responses must be >= 1, got {self.max_stored_responses}")
        if self.pooling not in ("last", "mean"):
            raise ValueError(f"pooling must be last or mean, got {self.pooling!r}")
        if self.reasoning_parser is not None:
            from sglite.runtime.reasoning import get_reasoning_format

            get_reasoning_format(self.reasoning_parser)
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}"
            )
        if self.gguf_activations not in GGUF_ACTIVATIONS:
            raise ValueError(
                f"gguf_activations must be one of {GGUF_ACTIVATIONS}, got {self.gguf_activations!r}"
            )
        if self.quantization not in ("auto", "none") and self.device != "cpu":
            raise ValueError("quantization uses PyTorch's CPU kernels; it needs device='cpu'")
        for name in ("tp_size", "dp_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in 0..{self.nnodes - 1}, got {self.node_rank}")
        if self.tp_size % self.nnodes:
            raise ValueError(f"tp_size ({self.tp_size}) must be a multiple of nnodes")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("multi-node tensor parallelism needs --dist-init-addr HOST:PORT")
        if self.nnodes > 1 and self.dp_size > 1:
            raise ValueError("dp_size > 1 is supported on one node only")
        if self.dp_policy not in DP_POLICIES:
            raise ValueError(f"dp_policy must be one of {DP_POLICIES}, got {self.dp_policy!r}")
        if self.dist_init_addr is not None and not _is_host_port(self.dist_init_addr):
            raise ValueError(f"dist_init_addr must be HOST:PORT, got {self.dist_init_addr!r}")
        if self.gemm_packing not in GEMM_PACKING:
            raise ValueError(
                f"gemm_packing must be one of {GEMM_PACKING}, got {self.gemm_packing!r}"
            )
        if self.quantized_max_rows is not None and self.quantized_max_rows < -1:
            raise ValueError(f"quantized_max_rows must be >= -1, got {self.quantized_max_rows}")
        if self.grammar_compile_timeout <= 0:
            raise ValueError("grammar_compile_timeout must be positive")
        for name in ("max_running_requests", "chunked_prefill_size", "max_prefill_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            raise ValueError(f"max_total_tokens must be >= 16, got {self.max_total_tokens}")
        for name in ("max_n", "max_request_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_new_tokens_limit", "request_timeout"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.graceful_shutdown_timeout < 0:
            raise ValueError("graceful_shutdown_timeout must be >= 0")
        if self.default_max_tokens < 0:
            raise ValueError(f"default_max_tokens must be >= 0, got {self.default_max_tokens}")
        self._validate_hicache()
        if self.context_length is not None and self.context_length <= 1:
            raise ValueError(f"context_length must be > 1, got {self.context_length}")

    def _validate_deterministic(self) -> None:
        if not self.enable_deterministic_inference:
            return
        if self.device != "cpu":
            raise ValueError("enable_deterministic_inference needs device='cpu' (native kernels)")
        if self.tp_size > 1:
            raise ValueError("enable_deterministic_inference is not supported with tp_size > 1")
        if self.quantization == "w4a8":
            raise ValueError(
                "enable_deterministic_inference: quantization 'w4a8' rounds activations per "
                "batch of rows; use int4"
            )
        if self.quantized_max_rows not in (None, -1):
            raise ValueError(
                "enable_deterministic_inference uses one weight for every batch size: "
                "quantized_max_rows must be unset or -1"
            )

    def _validate_draft_model(self) -> None:
        draft = self.speculative_algorithm == "draft"
        if draft and not self.speculative_draft_model_path:
            raise ValueError("speculative_algorithm='draft' needs speculative_draft_model_path")
        if not draft and self.speculative_draft_model_path is not None:
            raise ValueError(
                "speculative_draft_model_path is used with speculative_algorithm='draft' only"
            )
        if draft and self.tp_size > 1:
            # The draft model runs on rank 0 alone; it is not sharded.
            raise ValueError("speculative_algorithm='draft' is not supported with tp_size > 1")
        if self.speculative_draft_model_quantization not in QUANTIZATIONS:
            raise ValueError(
                f"speculative_draft_model_quantization must be one of {QUANTIZATIONS}, "
                f"got {self.speculative_draft_model_quantization!r}"
            )
        layers = self.speculative_draft_num_layers
        if layers is not None and layers < 1:
            raise ValueError(f"speculative_draft_num_layers must be >= 1, got {layers}")

    def _validate_disaggregation(self) -> None:
        mode = self.disaggregation_mode
        if mode is not None and mode not in DISAGGREGATION_MODES:
            raise ValueError(
                f"disaggregation_mode must be one of {DISAGGREGATION_MODES}, got {mode!r}"
            )
        if self.disaggregation_transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(
                f"disaggregation_transfer_backend must be one of {TRANSFER_BACKENDS}, "
                f"got {self.disaggregation_transfer_backend!r}"
            )
        if not 1 <= self.disaggregation_bootstrap_port <= 65535:
            raise ValueError(
                "disaggregation_bootstrap_port must be in [1, 65535], "
                f"got {self.disaggregation_bootstrap_port}"
            )
        if self.disaggregation_transfer_timeout <= 0:
            raise ValueError("disaggregation_transfer_timeout must be > 0")
        if mode is not None and (self.tp_size > 1 or self.dp_size > 1):
            # One scheduler process per server owns the bootstrap socket and the whole pool.
            raise ValueError("disaggregation_mode is supported with tp_size 1 and dp_size 1 only")

    def _validate_hicache(self) -> None:
        for name, choices in (
            ("hicache_write_policy", HICACHE_WRITE_POLICIES),
            ("hicache_load_policy", HICACHE_LOAD_POLICIES),
            ("radix_eviction_policy", RADIX_EVICTION_POLICIES),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        if not self.hicache_size >= 0:  # also rejects NaN
            raise ValueError(f"hicache_size must be >= 0 (GB), got {self.hicache_size}")
        if self.hicache_page_size < 1:
            raise ValueError(f"hicache_page_size must be >= 1, got {self.hicache_page_size}")
        if self.min_cached_prefix < 0:
            raise ValueError(f"min_cached_prefix must be >= 0, got {self.min_cached_prefix}")
        if self.hicache_quantize and self.hicache_size <= 0:
            raise ValueError("hicache_quantize needs a host tier (hicache_size > 0)")
        if self.hicache_dir is not None and not self.hicache_dir:
            raise ValueError("hicache_dir must be a directory path, got an empty string")
        tiered = self.hicache_size > 0 or self.hicache_dir is not None
        if tiered and self.tp_size > 1:
            # Promotion copies a host/disk span into rank 0's pool only; the other ranks' shards
            # of that span would be missing.
            raise ValueError("hicache_size / hicache_dir are not supported with tp_size > 1")
        if self.disable_radix_cache and (tiered or self.radix_eviction_policy != "lru"):
            raise ValueError("hicache_size / hicache_dir / radix_eviction_policy need the radix "
                             "cache; drop disable_radix_cache")  # fmt: skip

    @classmethod
    def from_kwargs(cls, engine: bool = False, **kwargs) -> ServerArgs:
        """Build from keyword arguments, rejecting unknown names (and for the in-process
        `engine`, the server's own options) with a clear error."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        server_only = sorted(set(kwargs) & SERVER_ONLY) if engine else []
        if server_only:
            raise TypeError(
                f"{', '.join(server_only)}: server option(s), not taken by the in-process Engine"
            )
        args = cls(**kwargs)
        args.validate()
        return args

    def resolved_num_threads(self) -> int:
        """Compute threads of one scheduler process: as set, else the cores shared by the
        scheduler processes of this node (tp ranks per node x dp replicas)."""
        if self.num_threads:
            return self.num_threads
        local = max(1, self.tp_size // self.nnodes) * self.dp_size
        return max(1, (os.cpu_count() or 1) // local)


# Options only the HTTP server acts on (`Engine(...)` refuses them).
SERVER_ONLY = frozenset(
    {
        "host", "port", "api_key", "served_model_name", "strict_model_name", "tool_call_parser",
        "disable_lenient_tool_calls",
        "reasoning_parser", "max_stored_responses", "max_request_body_bytes", "allow_origins",
        "graceful_shutdown_timeout", "restart_on_failure", "disable_web_ui",
        "disaggregation_mode", "disaggregation_bootstrap_port", "disaggregation_transfer_backend",
        "disaggregation_transfer_timeout",
    }
)  # fmt: skip
