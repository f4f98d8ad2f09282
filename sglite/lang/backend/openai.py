"""`sgl.OpenAI(model_name, base_url=None, api_key=None, is_chat_model=None)`: run programs on
any OpenAI-compatible endpoint through the official `openai` client.

Works with OpenAI itself, vLLM, SGLang, llama.cpp's server and `sglite serve` (`base_url`
ending in `/v1`). A **completion model** (`/v1/completions`) continues the program's text, as a
native backend does; a **chat model** (`/v1/chat/completions`) receives the finished turns as
messages and generates inside the open assistant turn (a gen after some assistant text
continues that partial message with `continue_final_message`, which sglite, SGLang and vLLM
accept). Everything the endpoint charges is counted in `backend.token_usage`.

With `@sgl.function(num_api_spec_tokens=N)` programs make fewer calls (see
`api_speculative.py`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sglite.lang.backend import api_select
from sglite.lang.backend.api_speculative import (
    DEFAULT_MAX_TRIES,
    ApiSpeculation,
    SpecReply,
    token_ends_from_pieces,
)
from sglite.lang.backend.base import BaseBackend, apply_dtype
from sglite.lang.chat_template import (
    ChatTemplate,
    get_chat_template,
    get_chat_template_by_model_path,
)
from sglite.lang.choices import ChoicesDecision, ChoicesSamplingMethod, token_length_normalized
from sglite.lang.ir import SglSamplingParams

if TYPE_CHECKING:
    from sglite.lang.stream_executor import StreamExecutor

logger = logging.getLogger(__name__)

# Models served only through /v1/completions (SGLang's list plus OpenAI's base models); any other
# name is taken to be a chat model unless `is_chat_model` says otherwise.
COMPLETION_MODEL_NAMES = ("gpt-3.5-turbo-instruct", "davinci-002", "babbage-002")


@dataclass
class TokenUsage:
    """What the endpoint reported, summed over every call of the backend (thread-safe).

    `prompt_tokens` and `completion_tokens` are the `usage` of each response (streams ask for
    it with `stream_options.include_usage`); `num_calls` counts API requests that succeeded.
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    num_calls: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, prompt_tokens: int = 0, completion_tokens: int = 0, calls: int = 0) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens
            self.num_calls += calls

    def reset(self) -> None:
        with self._lock:
            self.prompt_tokens = self.completion_tokens = self.num_calls = 0

    def snapshot(self) -> TokenUsage:
        """A copy of the counters now."""
        with self._lock:
            return TokenUsage(self.prompt_tokens, self.completion_tokens, self.num_calls)


class OpenAI(BaseBackend):
    """A backend on an OpenAI-compatible API.

    `base_url`/`api_key` go to `openai.OpenAI` (a local `base_url` without a key gets a dummy
    one); `client` replaces the client altogether (an `openai.OpenAI` or anything with its
    `completions` / `chat.completions` methods). `is_chat_model` defaults to True except for
    the known completion-only models. `chat_template` (a name or a `ChatTemplate`) renders roles
    into the text: the prompt itself for a completion model, only `s.text()` for a chat model;
    by default it is matched from the model name. `select_method` is "auto" (echoed logprobs,
    else logit bias), "logprobs" or "logit_bias"; the logit-bias method needs `tokenizer` (a
    Hugging Face or tiktoken tokenizer of the served model). `max_spec_tries` bounds the calls
    of one speculative chat turn. `is_azure` builds an `openai.AzureOpenAI` client from
    `client_kwargs` instead (SGLang's option).
    """

    def __init__(
        self,
        model_name: str,
        base_url: str | None = None,
        api_key: str | None = None,
        is_chat_model: bool | None = None,
        chat_template: str | ChatTemplate | None = None,
        client: Any = None,
        tokenizer: Any = None,
        select_method: str = "auto",
        max_spec_tries: int = DEFAULT_MAX_TRIES,
        is_azure: bool = False,
        **client_kwargs: Any,
    ) -> None:
        super().__init__()
        if select_method not in ("auto", "logprobs", "logit_bias"):
            raise ValueError(
                f"select_method must be auto, logprobs or logit_bias, not {select_method!r}"
            )
        self.model_name = model_name
        if client is None:
            client = _make_client(base_url, api_key, is_azure, client_kwargs)
        self.client = client
        if is_chat_model is None:
            is_chat_model = model_name not in COMPLETION_MODEL_NAMES
        self.is_chat_model = bool(is_chat_model)
        if isinstance(chat_template, ChatTemplate):
            self.chat_template = chat_template
        elif chat_template:
            self.chat_template = get_chat_template(chat_template)
        else:
            self.chat_template = get_chat_template_by_model_path(model_name)
        self.tokenizer = tokenizer
        self.select_method = select_method
        self.max_spec_tries = max_spec_tries
        self.token_usage = TokenUsage()
        # Learnt from the endpoint's first refusal (None = not tried yet).
        self._echo_logprobs_ok: bool | None = None
        self._spec_logprobs_ok: bool | None = None
        self._constraints_ok: bool | None = None
        self._warn_lock = threading.Lock()

    def get_model_name(self) -> str:
        return self.model_name

    def new_api_speculation(self, num_api_spec_tokens: int) -> ApiSpeculation:
        return ApiSpeculation(self, num_api_spec_tokens, self.max_spec_tries)

    # ------------------------------------------------------------------ requests
    def _create(self, **kwargs: Any) -> Any:
        """One non-streamed request; its usage is counted."""
        api = self.client.chat.completions if "messages" in kwargs else self.client.completions
        response = api.create(model=self.model_name, **kwargs)
        usage = getattr(response, "usage", None)
        self.token_usage.add(
            getattr(usage, "prompt_tokens", 0) or 0,
            getattr(usage, "completion_tokens", 0) or 0,
            calls=1,
        )
        return response

    def _request(self, s: StreamExecutor, params: SglSamplingParams) -> tuple[dict, bool]:
        """The keyword arguments of a request continuing `s` with `params` (sampling, stop,
        logprobs, constraints, the prompt or messages), and whether its regex came from
        `dtype` (then it may be dropped if the endpoint refuses it)."""
        params = params.clone()
        from_dtype = apply_dtype(params)
        chat = self.is_chat_model
        kwargs: dict[str, Any] = {"max_tokens": params.max_new_tokens}
        extra: dict[str, Any] = {}
        if chat:
            kwargs["messages"], extra = self._chat_messages(s)
        else:
            kwargs["prompt"] = s.text_
        kwargs.update(_sampling_kwargs(params))
        extra.update(_sampling_extras(params))
        stops = params.stop_list()
        if chat:  # the server ends the turn itself; the template's stop strings are noise
            stops = [x for x in stops if x not in self.chat_template.stop_str]
        if stops:
            kwargs["stop"] = stops
        if (params.n or 1) > 1:
            kwargs["n"] = params.n
        if params.return_logprob:
            if chat:
                kwargs["logprobs"] = True
                if params.top_logprobs_num:
                    kwargs["top_logprobs"] = params.top_logprobs_num
            else:
                kwargs["logprobs"] = params.top_logprobs_num or 0
        if params.regex is not None:
            extra["regex"] = params.regex
        if params.ebnf is not None:  # SGLang-compatible servers (sglite, SGLang) take it
            extra["ebnf"] = params.ebnf
        if params.json_schema is not None:
            if chat:
                kwargs["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "output",
                        "schema": json.loads(params.json_schema),
                        "strict": True,
                    },
                }
            else:
                extra["json_schema"] = params.json_schema
        if extra:
            kwargs["extra_body"] = extra
        return kwargs, from_dtype

    def _chat_messages(self, s: StreamExecutor) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The finished turns, plus the open assistant turn's text when it has some (continued
        with `continue_final_message`), and the extra body fields that asks for."""
        if s.cur_role != "assistant":
            raise ValueError(
                f"{self.model_name} is a chat model: sgl.gen must be inside an assistant turn "
                "(s += sgl.assistant(sgl.gen(...))); use is_chat_model=False for a completion model"
            )
        messages = [dict(m) for m in s.messages_]
        begin = s.cur_role_begin_pos if s.cur_role_begin_pos is not None else len(s.text_)
        partial = s.text_[begin:].lstrip()
        if not partial:
            return messages, {}
        messages.append({"role": "assistant", "content": partial})
        return messages, {"continue_final_message": True, "add_generation_prompt": False}

    def _call(self, kwargs: dict[str, Any], from_dtype: bool) -> Any:
        """`_create(**kwargs)`; a `dtype` regex the endpoint refuses is dropped (one warning)."""
        if from_dtype and self._constraints_ok is False:
            _drop_regex(kwargs)
            return self._create(**kwargs)
        try:
            return self._create(**kwargs)
        except Exception as exc:
            if not (from_dtype and _is_bad_request(exc)):
                raise
            with self._warn_lock:
                if self._constraints_ok is None:
                    warnings.warn(
                        f"the endpoint refused the regex of a dtype= generation ({exc}); "
                        "such generations run unconstrained",
                        stacklevel=2,
                    )
                self._constraints_ok = False
            _drop_regex(kwargs)
            return self._create(**kwargs)

    # ------------------------------------------------------------------ generation
    def generate(
        self, s: StreamExecutor, sampling_params: SglSamplingParams
    ) -> tuple[str | list[str], dict[str, Any] | list[dict[str, Any]]]:
        kwargs, from_dtype = self._request(s, sampling_params)
        response = self._call(kwargs, from_dtype)
        answers = sorted(response.choices, key=lambda c: c.index)
        texts = [_choice_text(c) for c in answers]
        metas = [_meta(response, c) for c in answers]
        if (sampling_params.n or 1) > 1:
            return texts, metas
        return texts[0], metas[0]

    def generate_stream(
        self, s: StreamExecutor, sampling_params: SglSamplingParams
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        kwargs, from_dtype = self._request(s, sampling_params)
        if from_dtype and self._constraints_ok is False:
            _drop_regex(kwargs)
        api = self.client.chat.completions if "messages" in kwargs else self.client.completions
        stream = api.create(
            model=self.model_name, stream=True, stream_options={"include_usage": True}, **kwargs
        )
        self.token_usage.add(calls=1)
        meta: dict[str, Any] = {}
        for chunk in stream:
            usage = getattr(chunk, "usage", None)
            if usage is not None:
                self.token_usage.add(usage.prompt_tokens or 0, usage.completion_tokens or 0)
                meta = {**meta, **_usage_meta(usage)}
            for choice in chunk.choices or []:
                if choice.index != 0:
                    continue
                text = _delta_text(choice)
                meta = {**meta, "id": chunk.id}
                if choice.finish_reason is not None:
                    meta["finish_reason"] = _finish(choice)
                if text:
                    yield text, meta
        yield "", meta  # the final meta info (usage arrives after the last text)

    def spec_call(self, s: StreamExecutor, params: SglSamplingParams, max_tokens: int) -> SpecReply:
        """One speculative call: `params`' sampling settings, no stop strings, `max_tokens`
        tokens, and per-token text (logprobs) when the endpoint gives it, to count tokens."""
        kwargs: dict[str, Any] = {"max_tokens": max_tokens, **_sampling_kwargs(params)}
        extra = _sampling_extras(params)
        if self.is_chat_model:
            kwargs["messages"], more = self._chat_messages(s)
            extra.update(more)
        else:
            kwargs["prompt"] = s.text_
        if extra:
            kwargs["extra_body"] = extra
        response = None
        if self._spec_logprobs_ok is not False:
            with_pieces = dict(kwargs, logprobs=True if self.is_chat_model else 0)
            try:
                response = self._create(**with_pieces)
                self._spec_logprobs_ok = True
            except Exception as exc:
                if self._spec_logprobs_ok or not _is_bad_request(exc):
                    raise
                self._spec_logprobs_ok = False  # counted by characters from now on
        if response is None:
            response = self._create(**kwargs)
        choice = sorted(response.choices, key=lambda c: c.index)[0]
        text = _choice_text(choice)
        return SpecReply(
            text=text,
            finished=choice.finish_reason == "stop",
            token_ends=token_ends_from_pieces(text, _pieces(choice)),
            max_tokens=max_tokens,
            meta=_meta(response, choice, with_logprobs=False),
        )

    # ------------------------------------------------------------------ select
    def select(
        self,
        s: StreamExecutor,
        choices: list[str],
        temperature: float,
        choices_method: ChoicesSamplingMethod | None = None,
    ) -> ChoicesDecision:
        """The choice the model prefers after `s.text_` (completion models only): by echoed
        logprobs and `choices_method`, else (or with `select_method="logit_bias"`) by logit
        bias, where `choices_method` does not apply."""
        if self.is_chat_model:
            raise ValueError(
                f"select needs a completion model; {self.model_name} is used as a chat model "
                "(pass is_chat_model=False if its endpoint serves /v1/completions)"
            )
        if temperature > 1e-5:
            raise ValueError("select does not sample: its temperature must be 0")
        method = choices_method or token_length_normalized
        if self.select_method != "logit_bias" and self._echo_logprobs_ok is not False:
            try:
                decision = api_select.select_by_echo_logprobs(
                    self._create, s.text_, choices, method
                )
                self._echo_logprobs_ok = True
                return decision
            except Exception as exc:
                usable = isinstance(exc, api_select.NoLogprobs) or _is_bad_request(exc)
                if self.select_method == "logprobs" or self._echo_logprobs_ok or not usable:
                    raise
                logger.info("echoed logprobs unavailable (%s); select uses logit bias", exc)
                self._echo_logprobs_ok = False
        if self.tokenizer is None:
            raise ValueError(
                "select by logit bias needs the model's tokenizer: pass tokenizer= to sgl.OpenAI "
                "(the endpoint does not return echoed prompt logprobs)"
            )
        return api_select.select_by_logit_bias(self._create, self.tokenizer, s.text_, choices)


# ============================================================================ helpers
def _make_client(
    base_url: str | None, api_key: str | None, is_azure: bool, kwargs: dict[str, Any]
) -> Any:
    try:
        import openai
    except ImportError as exc:  # the language itself needs no HTTP client
        raise ImportError("sgl.OpenAI needs the openai package: pip install openai") from exc
    if is_azure:  # SGLang's option: Azure's endpoint and credentials come in kwargs
        return openai.AzureOpenAI(api_key=api_key, **kwargs)
    if api_key is None and base_url is not None and not os.environ.get("OPENAI_API_KEY"):
        api_key = "EMPTY"  # local servers without --api-key ignore it; the client insists
    return openai.OpenAI(base_url=base_url, api_key=api_key, **kwargs)


def _is_bad_request(exc: BaseException) -> bool:
    """Whether `exc` is the endpoint refusing the request (HTTP 400 / 422)."""
    return getattr(exc, "status_code", None) in (400, 422)


def _drop_regex(kwargs: dict[str, Any]) -> None:
    extra = kwargs.get("extra_body")
    if extra:
        extra.pop("regex", None)


def _sampling_kwargs(params: SglSamplingParams) -> dict[str, Any]:
    """OpenAI's own sampling fields (penalties only when set, as some endpoints refuse them)."""
    out: dict[str, Any] = {}
    if params.temperature is not None:
        out["temperature"] = params.temperature
    if params.top_p is not None and params.top_p != 1.0:
        out["top_p"] = params.top_p
    if params.frequency_penalty:
        out["frequency_penalty"] = params.frequency_penalty
    if params.presence_penalty:
        out["presence_penalty"] = params.presence_penalty
    return out


def _sampling_extras(params: SglSamplingParams) -> dict[str, Any]:
    """SGLang / vLLM extra fields (sent in the body only when they differ from the defaults,
    so endpoints without them, such as OpenAI, are not sent what they would refuse)."""
    extra: dict[str, Any] = {}
    if params.top_k not in (None, -1, 0):
        extra["top_k"] = params.top_k
    if params.min_p:
        extra["min_p"] = params.min_p
    if params.min_new_tokens:
        extra["min_tokens"] = params.min_new_tokens
    if params.ignore_eos:
        extra["ignore_eos"] = True
    if params.stop_token_ids:
        extra["stop_token_ids"] = list(params.stop_token_ids)
    return extra


def _choice_text(choice: Any) -> str:
    message = getattr(choice, "message", None)
    if message is not None:
        return message.content or ""
    return choice.text or ""


def _delta_text(choice: Any) -> str:
    delta = getattr(choice, "delta", None)
    if delta is not None:
        return delta.content or ""
    return getattr(choice, "text", None) or ""


def _finish(choice: Any) -> dict[str, Any]:
    return {"type": choice.finish_reason, "matched": getattr(choice, "matched_stop", None)}


def _usage_meta(usage: Any) -> dict[str, Any]:
    meta = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens}
    details = getattr(usage, "prompt_tokens_details", None)
    if details is not None and getattr(details, "cached_tokens", None) is not None:
        meta["cached_tokens"] = details.cached_tokens
    return meta


def _meta(response: Any, choice: Any, with_logprobs: bool = True) -> dict[str, Any]:
    """Meta info of one choice, shaped like the native `meta_info` (usage is the response's)."""
    meta: dict[str, Any] = {"id": response.id, "finish_reason": _finish(choice)}
    if getattr(response, "usage", None) is not None:
        meta.update(_usage_meta(response.usage))
    entries = _logprob_entries(choice) if with_logprobs else None
    if entries is not None:
        meta["output_token_logprobs"], tops = entries
        if any(tops):
            meta["output_top_logprobs"] = tops
    return meta


def _pieces(choice: Any) -> list[str] | None:
    """The choice's tokens as text (from its logprobs), or None."""
    entries = _logprob_entries(choice)
    return None if entries is None else [e[2] for e in entries[0]]


def _logprob_entries(choice: Any) -> tuple[list[list[Any]], list[Any]] | None:
    """`[logprob, None, token]` per output token and the top alternatives per position, from
    either the completions or the chat logprobs shape; None without logprobs."""
    logprobs = getattr(choice, "logprobs", None)
    if logprobs is None:
        return None
    content = getattr(logprobs, "content", None)
    if content is not None:  # chat
        entries = [[t.logprob, None, t.token] for t in content]
        tops = [[[x.logprob, None, x.token] for x in (t.top_logprobs or [])] for t in content]
        return entries, tops
    tokens = getattr(logprobs, "tokens", None)
    if tokens is None:
        return None
    values = list(logprobs.token_logprobs or [None] * len(tokens))
    entries = [[lp, None, tok] for lp, tok in zip(values, tokens)]
    tops = [
        [[lp, None, tok] for tok, lp in (top or {}).items()]
        for top in (logprobs.top_logprobs or [None] * len(tokens))
    ]
    return entries, tops
