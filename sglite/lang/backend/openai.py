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

This module holds the backend (`OpenAI`); building requests is in `openai_request.py`, reading
responses (and `TokenUsage`, importable from here as in SGLang) in `openai_response.py`.
"""

from __future__ import annotations

import json
import logging
import threading
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from sglite.lang.backend import api_select
from sglite.lang.backend.api_speculative import DEFAULT_MAX_TRIES, ApiSpeculation
from sglite.lang.backend.api_speculative_reply import SpecReply, token_ends_from_pieces
from sglite.lang.backend.base import BaseBackend, apply_dtype
from sglite.lang.backend.openai_request import (
    drop_regex,
    is_bad_request,
    make_client,
    sampling_extras,
    sampling_kwargs,
)
from sglite.lang.backend.openai_response import (
    TokenUsage,  # importable from here too: SGLang has it in `sglang.lang.backend.openai`
    choice_text,
    delta_text,
    finish_meta,
    response_meta,
    token_pieces,
    usage_meta,
)
from sglite.lang.chat_template import (
    ChatTemplate,
    get_chat_template,
    get_chat_template_by_model_path,
)
from sglite.lang.choices import ChoicesDecision, ChoicesSamplingMethod, token_length_normalized
from sglite.lang.sampling_params import SglSamplingParams

if TYPE_CHECKING:
    from sglite.lang.stream_executor import StreamExecutor

logger = logging.getLogger(__name__)

# Models served only through /v1/completions (SGLang's list plus OpenAI's base models); any other
# name is taken to be a chat model unless `is_chat_model` says otherwise.
COMPLETION_MODEL_NAMES = ("gpt-3.5-turbo-instruct", "davinci-002", "babbage-002")


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
            client = make_client(base_url, api_key, is_azure, client_kwargs)
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
        kwargs.update(sampling_kwargs(params))
        extra.update(sampling_extras(params))
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
            drop_regex(kwargs)
            return self._create(**kwargs)
        try:
            return self._create(**kwargs)
        except Exception as exc:
            if not (from_dtype and is_bad_request(exc)):
                raise
            with self._warn_lock:
                if self._constraints_ok is None:
                    warnings.warn(
                        f"the endpoint refused the regex of a dtype= generation ({exc}); "
                        "such generations run unconstrained",
                        stacklevel=2,
                    )
                self._constraints_ok = False
            drop_regex(kwargs)
            return self._create(**kwargs)

    # ------------------------------------------------------------------ generation
    def generate(
        self, s: StreamExecutor, sampling_params: SglSamplingParams
    ) -> tuple[str | list[str], dict[str, Any] | list[dict[str, Any]]]:
        kwargs, from_dtype = self._request(s, sampling_params)
        response = self._call(kwargs, from_dtype)
        answers = sorted(response.choices, key=lambda c: c.index)
        texts = [choice_text(c) for c in answers]
        metas = [response_meta(response, c) for c in answers]
        if (sampling_params.n or 1) > 1:
            return texts, metas
        return texts[0], metas[0]

    def generate_stream(
        self, s: StreamExecutor, sampling_params: SglSamplingParams
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        kwargs, from_dtype = self._request(s, sampling_params)
        if from_dtype and self._constraints_ok is False:
            drop_regex(kwargs)
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
                meta = {**meta, **usage_meta(usage)}
            for choice in chunk.choices or []:
                if choice.index != 0:
                    continue
                text = delta_text(choice)
                meta = {**meta, "id": chunk.id}
                if choice.finish_reason is not None:
                    meta["finish_reason"] = finish_meta(choice)
                if text:
                    yield text, meta
        yield "", meta  # the final meta info (usage arrives after the last text)

    def spec_call(self, s: StreamExecutor, params: SglSamplingParams, max_tokens: int) -> SpecReply:
        """One speculative call: `params`' sampling settings, no stop strings, `max_tokens`
        tokens, and per-token text (logprobs) when the endpoint gives it, to count tokens."""
        kwargs: dict[str, Any] = {"max_tokens": max_tokens, **sampling_kwargs(params)}
        extra = sampling_extras(params)
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
                if self._spec_logprobs_ok or not is_bad_request(exc):
                    raise
                self._spec_logprobs_ok = False  # counted by characters from now on
        if response is None:
            response = self._create(**kwargs)
        choice = sorted(response.choices, key=lambda c: c.index)[0]
        text = choice_text(choice)
        return SpecReply(
            text=text,
            finished=choice.finish_reason == "stop",
            token_ends=token_ends_from_pieces(text, token_pieces(choice)),
            max_tokens=max_tokens,
            meta=response_meta(response, choice, with_logprobs=False),
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
                usable = isinstance(exc, api_select.NoLogprobs) or is_bad_request(exc)
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
