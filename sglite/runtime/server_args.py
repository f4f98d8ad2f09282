"""One dataclass of arguments shared by the CLI (`sglite serve`) and `sglite.Engine(**kwargs)`.

Every server flag `--foo-bar` is the keyword `foo_bar=` of the Engine, so a setting means the same
thing on both paths.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from sglite.runtime.server_args_checks import validate_server_args


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
        """Raise ValueError naming the first bad argument (`server_args_checks`); normalizes
        SGLang's aliases (speculative_algorithm "standalone" is "draft")."""
        validate_server_args(self)

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
