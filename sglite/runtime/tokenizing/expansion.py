"""Request expansion: batch arguments split into per-prompt values, and `n > 1` into choices.

A batch argument is given either once for every prompt or as a list with one entry per prompt.
`expand_n` keeps prompt-major order (prompt 0's choices, then prompt 1's, ...), which the HTTP
layer relies on to put choices back together and disaggregated serving to number rooms.
"""

from __future__ import annotations

from typing import Any

from sglite.runtime.multimodal.image_input import ImageInputError
from sglite.runtime.tokenizing.request import GenerateRequest


def pick(value: Any, i: int, n: int) -> Any:
    """Per-item value of an argument given either once for all items or as a list of n."""
    if isinstance(value, list) and len(value) == n:
        return value[i]
    return value


def per_prompt_segments(segments: list | None, n: int, is_batch: bool) -> list[list[Any]]:
    """Each prompt's segment spans: a list of spans for one prompt, a list of n for a batch."""
    if segments is None:
        return [[] for _ in range(n)]
    if not isinstance(segments, list):
        raise ValueError("segments must be a list of [start, end] spans")
    if not is_batch:
        return [segments]
    if len(segments) != n or not all(isinstance(s, list) for s in segments):
        raise ValueError(f"segments: a batch of {n} prompts needs a list of {n} span lists")
    return segments


def per_prompt_images(image_data: Any, n: int, is_batch: bool) -> list[list[Any]]:
    """Each prompt's list of images (empty lists without `image_data`): one image or a list for
    one prompt, a list of n such entries (None for none) for a batch."""
    if image_data is None:
        return [[] for _ in range(n)]
    if not is_batch:
        return [image_data if isinstance(image_data, list) else [image_data]]
    if not isinstance(image_data, list) or len(image_data) != n:
        raise ImageInputError(f"image_data: a batch of {n} prompts needs a list of {n} entries")
    return [[] if d is None else d if isinstance(d, list) else [d] for d in image_data]


def expand_n(reqs: list[GenerateRequest]) -> list[GenerateRequest]:
    """Replace each request with n > 1 by n requests (prompt-major order, distinct seeds).

    Choice j of request `rid` is `f"{rid}-{j}"` with n = 1 and seed `seed + j` (when seeded);
    the choices share the prompt's ids, images and segments (the same lists, not copies).
    """
    out: list[GenerateRequest] = []
    for req in reqs:
        n = req.sampling_params.get("n", 1)
        if n == 1:
            out.append(req)
            continue
        for j in range(n):
            params = dict(req.sampling_params, n=1)
            if params.get("seed") is not None:
                params["seed"] = params["seed"] + j
            out.append(
                GenerateRequest(
                    req.input_ids,
                    params,
                    f"{req.rid}-{j}",
                    req.return_logprob,
                    req.logprob_start_len,
                    req.top_logprobs_num,
                    req.return_text_in_logprobs,
                    images=req.images,
                    segments=req.segments,
                )
            )
    return out
