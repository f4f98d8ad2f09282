"""Public functions of the language (`import sglite as sgl`), named and shaped as SGLang's."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from typing import Any

from sglite.lang.choices import ChoicesSamplingMethod, token_length_normalized
from sglite.lang.global_config import global_config
from sglite.lang.ir import (
    SglExpr,
    SglExprList,
    SglGen,
    SglImage,
    SglRoleBegin,
    SglRoleEnd,
    SglSegment,
    SglSelect,
    as_expr,
)
from sglite.lang.program import SglFunction
from sglite.lang.sampling_params import SglSamplingParams
from sglite.lang.tools import tool_grammar


def function(func: Callable[..., Any] | None = None, num_api_spec_tokens: int | None = None) -> Any:
    """Decorate a program: `@sgl.function` or `@sgl.function(num_api_spec_tokens=N)`.

    The function's first argument must be `s`, the program state. `num_api_spec_tokens` is API
    speculative execution for OpenAI-style backends; native backends ignore it.
    """
    if func is not None:
        return SglFunction(func, num_api_spec_tokens=num_api_spec_tokens)

    def decorator(f: Callable[..., Any]) -> SglFunction:
        return SglFunction(f, num_api_spec_tokens=num_api_spec_tokens)

    return decorator


def Runtime(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 - SGLang's name
    """Start a server in a child process; see `sglite.lang.backend.runtime.Runtime`."""
    from sglite.lang.backend.runtime import Runtime as _Runtime

    return _Runtime(*args, **kwargs)


def set_default_backend(backend: Any) -> None:
    """Make `backend` the one programs run on when `run(backend=...)` is not given.

    Accepts a `RuntimeEndpoint`, an `EngineBackend`, an `sglite.Engine` (wrapped in an
    `EngineBackend`) or a `Runtime` (its endpoint).
    """
    from sglite.lang.backend.engine_backend import as_backend

    global_config.default_backend = as_backend(backend) if backend is not None else None


def _backend(backend: Any) -> Any:
    from sglite.lang.backend.engine_backend import as_backend

    backend = backend if backend is not None else global_config.default_backend
    return None if backend is None else as_backend(backend)


def flush_cache(backend: Any = None) -> Any:
    """Empty the backend's radix cache (False when there is no backend)."""
    backend = _backend(backend)
    if backend is None:
        return False
    return backend.flush_cache()


def get_server_info(backend: Any = None) -> Any:
    """The backend's server info (arguments and live stats; None when there is no backend)."""
    backend = _backend(backend)
    if backend is None:
        return None
    return backend.get_server_info()


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: list[str] | None = None,
    choices_method: ChoicesSamplingMethod | None = None,
    regex: str | None = None,
    json_schema: str | dict | None = None,
    tools: list[Any] | None = None,
    tool_choice: str = "required",
    parallel_tool_calls: bool = False,
) -> SglGen | SglSelect:
    """Let the model continue the text; the result is stored as variable `name`.

    Unset parameters take the run's defaults. With `choices`, this is `select` (the choice the
    model's logprobs favour). `regex` / `json_schema` (a string or a dict) constrain the output:
    the runtime only samples tokens that keep it a match / valid JSON under the schema. A
    malformed one raises ValueError (the grammar parser's message) here, where it is written.
    `dtype` (int, float, str, bool) is shorthand for SGLang's regex of that type.
    With `n > 1` the variable is the list of n completions and the text continues with the first.
    `tools` (Python functions or OpenAI tool objects) make the output a call of one of them in
    the Hermes format, its arguments valid under the tool's schema (`tool_choice`: `required`,
    a function's name, or `auto`, which also allows plain text; `parallel_tool_calls` allows
    several); `state.tool_calls(name)` returns the parsed calls (see `sglite.lang.tools`).
    """
    if choices:
        return select(
            name,
            choices,
            0.0 if temperature is None else temperature,
            choices_method or token_length_normalized,
        )
    if regex is not None:
        _check_constraint("regex", regex)
    if json_schema is not None:
        if not isinstance(json_schema, str):
            json_schema = json.dumps(json_schema)
        _check_constraint("json_schema", json_schema)
    ebnf = None
    if tools:
        if regex is not None or json_schema is not None:
            raise ValueError("tools cannot be combined with regex or json_schema")
        ebnf = tool_grammar(tools, tool_choice, parallel_tool_calls)
    params = SglSamplingParams.unset(
        max_new_tokens=max_tokens,
        min_new_tokens=min_tokens,
        n=n,
        stop=stop,
        stop_token_ids=stop_token_ids,
        stop_regex=stop_regex,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        ignore_eos=ignore_eos,
        return_logprob=return_logprob,
        logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs,
        dtype=dtype,
        regex=regex,
        json_schema=json_schema,
        ebnf=ebnf,
    )
    return SglGen(name, params, tools)


@functools.lru_cache(maxsize=256)
def _check_constraint(kind: str, text: str) -> None:
    """Raise ValueError (GrammarError, with the parser's message) if the constraint is malformed.

    The check is the runtime's own (`sglite.runtime.constrained`, llguidance), so a constraint
    that passes here compiles there; Python's `re` would reject valid patterns such as `\\p{L}`.
    Type errors raise TypeError. Without the grammar package the runtime alone checks.
    """
    if not isinstance(text, str):
        raise TypeError(f"{kind} must be a string, got {type(text).__name__}")
    try:
        from sglite.runtime.constrained import validate_constraint
    except ImportError:
        return
    validate_constraint(kind, text)


def _typed_gen(name: str | None, dtype: type, values: dict[str, Any]) -> SglGen:
    return gen(name, dtype=dtype, **values)  # type: ignore[return-value]


def gen_int(
    name: str | None = None,
    max_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
) -> SglGen:
    """`gen` of an integer (`dtype=int`): constrained to `[-+]?[0-9]+` where the runtime supports
    constraints, else generated plainly up to the first space or newline."""
    values = dict(locals())
    return _typed_gen(values.pop("name"), int, values)


def gen_string(
    name: str | None = None,
    max_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
) -> SglGen:
    """`gen` of a double-quoted string (`dtype=str`); same fallback as `gen_int`."""
    values = dict(locals())
    return _typed_gen(values.pop("name"), str, values)


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesSamplingMethod = token_length_normalized,
) -> SglSelect:
    """Append the choice the model finds most likely after the text so far; stored as `name`.

    `choices_method` is `token_length_normalized` (default), `greedy_token_selection` or
    `unconditional_likelihood_normalized` (from `sglite.lang.choices`).
    """
    if not choices:
        raise ValueError("select needs a non-empty list of choices")
    if not all(isinstance(c, str) and c for c in choices):
        raise ValueError("select choices must be non-empty strings")
    return SglSelect(name, list(choices), temperature, choices_method)


def segment(text: str) -> SglSegment:
    """Text the runtime may reuse at any position in later prompts: `s += sgl.segment(passage)`
    appends `passage`, and its KV is cached by content, so the same passage in another order or
    after another question is assembled instead of recomputed (the server's
    `--segment-recompute-fraction` says how much of it is recomputed; backends without segments
    treat it as text)."""
    if not isinstance(text, str):
        raise TypeError(f"sgl.segment takes a string, got {type(text).__name__}")
    return SglSegment(text)


def image(path_or_bytes: str | bytes | os.PathLike) -> SglImage:
    """An image in the prompt, inside a role: `s += sgl.user(sgl.image("cat.png") + "What is
    this?")`. A file path or bytes are read now and sent as a base64 data: URL (so a server on
    another machine gets the picture); a data: URL or an http(s) URL is sent as it is."""
    if isinstance(path_or_bytes, (bytes, bytearray)):
        return SglImage(_data_url(bytes(path_or_bytes)))
    source = os.fspath(path_or_bytes)
    if source.startswith(("data:", "http://", "https://")):
        return SglImage(source)
    try:
        with open(source, "rb") as f:
            return SglImage(_data_url(f.read()))
    except OSError as exc:
        raise ValueError(f"sgl.image: cannot read {source!r} ({exc.strerror})") from None


def video(path: str | os.PathLike, num_frames: int = 8) -> SglExprList:
    """A video in the prompt as `num_frames` frames sampled evenly across it, each an image
    (`sgl.image`), as LLaVA-NeXT reads video. Decoded now by transformers' video loader with
    PyAV (`pip install av`); ValueError when the file cannot be read as a video."""
    if not isinstance(num_frames, int) or num_frames < 1:
        raise ValueError(f"sgl.video: num_frames must be a positive integer, got {num_frames!r}")
    source = os.fspath(path)
    try:
        from transformers.video_utils import load_video

        frames, _ = load_video(source, num_frames=num_frames, backend="pyav")
    except ImportError as exc:
        raise ValueError(f"sgl.video needs PyAV to decode videos (pip install av): {exc}") from None
    except Exception as exc:  # av's and transformers' errors for unreadable files
        raise ValueError(f"sgl.video: cannot read {source!r} as a video ({exc})") from None
    return SglExprList([image(_png(frame)) for frame in frames])


def _png(frame: Any) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, format="PNG")
    return buf.getvalue()


def _data_url(data: bytes) -> str:
    import base64

    # The server decodes by content; the media type only labels the URL.
    kind = "png" if data[:8] == b"\x89PNG\r\n\x1a\n" else "jpeg"
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def _role_common(name: str, expr: Any = None) -> SglExprList:
    if expr is None:
        return SglExprList([SglRoleBegin(name), SglRoleEnd(name)])
    return SglExprList([SglRoleBegin(name), as_expr(expr), SglRoleEnd(name)])


def system(expr: Any = None) -> SglExprList:
    """A system turn holding `expr`."""
    return _role_common("system", expr)


def user(expr: Any = None) -> SglExprList:
    """A user turn holding `expr`."""
    return _role_common("user", expr)


def assistant(expr: Any = None) -> SglExprList:
    """An assistant turn holding `expr` (generations inside stop at the template's end token)."""
    return _role_common("assistant", expr)


def system_begin() -> SglRoleBegin:
    return SglRoleBegin("system")


def system_end() -> SglRoleEnd:
    return SglRoleEnd("system")


def user_begin() -> SglRoleBegin:
    return SglRoleBegin("user")


def user_end() -> SglRoleEnd:
    return SglRoleEnd("user")


def assistant_begin() -> SglRoleBegin:
    return SglRoleBegin("assistant")


def assistant_end() -> SglRoleEnd:
    return SglRoleEnd("assistant")


__all__ = [
    "SglExpr", "function", "Runtime", "set_default_backend", "flush_cache", "get_server_info",
    "gen", "gen_int", "gen_string", "select", "system", "user", "assistant", "system_begin",
    "system_end", "user_begin", "user_end", "assistant_begin", "assistant_end",
]  # fmt: skip
