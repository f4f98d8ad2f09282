"""Hugging Face transformers as an sglite backend: the baseline most CPU users have.

`HFBackend` implements sglite's `BaseBackend` on `AutoModelForCausalLM` loaded from the same
GGUF file sglite serves (transformers dequantizes it), with the same thread count. Programs run
through sglite's interpreter unchanged; only the model calls differ:

- `generate`: "batched where the program allows": concurrent calls (from the harness's program
  threads) with the same sampling parameters are collected for a few milliseconds and run as one
  left-padded `model.generate`; a lone call runs alone. Stop strings end a row (a stopping
  criterion on the decoded text) and are cut from the output, as sglite does.
- `select`: each choice scored by the mean logprob of its own tokens after the prefix (sglite's
  default, token-length-normalized; the other `choices_method`s get the same inputs), all
  choices of concurrent selects in one forward pass.
- constraints: transformers has no regex / JSON-schema decoding, so those generations run
  unconstrained (counted in `unconstrained_calls`; the workload's check may then fail them).
- no prefix cache: every call prefills its whole prompt (the hit-rate column shows "-").

One worker thread owns the model, so torch's threads are never shared between two calls.
"""

from __future__ import annotations

import gc
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from benchmarks.ideal_cache import CallLog
from benchmarks.runners.common import System, default_threads
from sglite.lang.backend.base import BaseBackend, apply_dtype, mean_logprob
from sglite.lang.chat_template import from_tokenizer
from sglite.lang.choices import ChoicesDecision, token_length_normalized
from sglite.lang.sampling_params import SglSamplingParams

MAX_BATCH = 16  # rows per generate / scoring forward (the micro-batch cap)
COLLECT_S = 0.005  # how long the worker waits for more calls to join a batch


@dataclass
class _Job:
    kind: str  # "gen" or "score"
    key: tuple  # jobs with equal keys may share a batch
    ids: list[int]  # gen: prompt ids; score: prefix + choice ids
    start: int = 0  # score: index of the first scored token
    params: SglSamplingParams | None = None
    future: Future = field(default_factory=Future)


class HFBackend(BaseBackend):
    """sglite backend on a transformers causal LM (see the module docstring)."""

    def __init__(self, model: Any, tokenizer: Any, model_path: str) -> None:
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer  # sglite's Tokenizer wrapper (its `.hf` is transformers')
        self.model_path = model_path
        self.chat_template = from_tokenizer(tokenizer, model_path)
        self.log = CallLog()
        self.unconstrained_calls = 0
        self.forward_calls = self.forward_rows = 0  # generate / scoring batches and their rows
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._worker = threading.Thread(target=self._loop, daemon=True, name="hf-backend")
        self._worker.start()

    def get_model_name(self) -> str:
        return self.model_path

    def shutdown(self) -> None:
        self._queue.put(None)
        self._worker.join(60)

    # ------------------------------------------------------------------ language hooks
    def generate(
        self, s: Any, sampling_params: SglSamplingParams
    ) -> tuple[str | list[str], dict[str, Any] | list[dict[str, Any]]]:
        params = sampling_params.clone()
        apply_dtype(params)  # its stop strings apply; its regex cannot
        if params.regex is not None or params.json_schema is not None:
            self.unconstrained_calls += 1
        ids = self.tokenizer.encode(s.text_)
        key = (
            params.max_new_tokens, params.min_new_tokens, tuple(params.stop_list()),
            params.temperature, params.top_p, params.top_k, params.ignore_eos,
        )  # fmt: skip
        calls = [self.log.start(s.text_) for _ in range(params.n or 1)]
        jobs = [_Job("gen", key, ids, params=params) for _ in calls]
        for job in jobs:
            self._queue.put(job)
        outs = [job.future.result() for job in jobs]
        metas = []
        for call, (text, n_out, reason) in zip(calls, outs):
            call.output = text
            metas.append(
                {"prompt_tokens": len(ids), "completion_tokens": n_out, "finish_reason": reason}
            )
        if (params.n or 1) > 1:
            return [o[0] for o in outs], metas
        return outs[0][0], metas[0]

    def select(
        self, s: Any, choices: list[str], temperature: float, choices_method: Any = None
    ) -> ChoicesDecision:
        method = choices_method or token_length_normalized
        prefix_ids = self.tokenizer.encode(s.text_) if s.text_ else []
        jobs = []
        for c in choices:
            full = self.tokenizer.encode(s.text_ + c)
            # The choice's tokens start where the prefix's own tokenization stops agreeing
            # with prefix + choice (a boundary token merged with the choice belongs to it).
            start = 0
            while start < min(len(prefix_ids), len(full)) and prefix_ids[start] == full[start]:
                start += 1
            jobs.append(_Job("score", ("score",), full, start=max(start, 1)))
            self.log.add(s.text_ + c, "", generated=False)
        if method.requires_unconditional_logprobs:
            for c in choices:
                jobs.append(_Job("score", ("score",), self.tokenizer.encode(c), start=1))
        for job in jobs:
            self._queue.put(job)
        entries = [job.future.result() for job in jobs]
        conditional = entries[: len(choices)]
        uncond = None
        if method.requires_unconditional_logprobs:
            uncond = [
                [[None, j.ids[0], None], *e]
                for j, e in zip(jobs[len(choices) :], entries[len(choices) :])
            ]
        means = [mean_logprob(ent) for ent in conditional]
        return method(
            choices=choices,
            normalized_prompt_logprobs=means,
            input_token_logprobs=conditional,
            output_token_logprobs=[[] for _ in choices],
            unconditional_token_logprobs=uncond,
        )

    # ------------------------------------------------------------------ the model's thread
    def _loop(self) -> None:
        import torch

        with torch.inference_mode():
            while True:
                first = self._queue.get()
                if first is None:
                    return
                jobs = [first]
                deadline = time.monotonic() + COLLECT_S
                while True:  # collect whatever arrives while the others are still calling
                    try:
                        job = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                    except queue.Empty:
                        break
                    if job is None:
                        self._queue.put(None)
                        break
                    jobs.append(job)
                    deadline = time.monotonic() + COLLECT_S
                groups: dict[tuple, list[_Job]] = {}
                for job in jobs:
                    groups.setdefault(job.key, []).append(job)
                for group in groups.values():
                    for i in range(0, len(group), MAX_BATCH):
                        chunk = group[i : i + MAX_BATCH]
                        self.forward_calls += 1
                        self.forward_rows += len(chunk)
                        try:
                            if chunk[0].kind == "gen":
                                results = self._generate(chunk)
                            else:
                                results = self._score(chunk)
                        except Exception as exc:  # fails this batch's calls, not the worker
                            for job in chunk:
                                job.future.set_exception(exc)
                            continue
                        for job, result in zip(chunk, results):
                            job.future.set_result(result)

    def _left_pad(self, seqs: list[list[int]]) -> tuple[Any, Any]:
        import torch

        width = max(len(x) for x in seqs)
        pad = self.tokenizer.eos_token_ids[0]
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, x in enumerate(seqs):
            ids[i, width - len(x) :] = torch.tensor(x)
            mask[i, width - len(x) :] = 1
        return ids, mask

    def _generate(self, jobs: list[_Job]) -> list[tuple[str, int, str]]:
        from transformers import StoppingCriteriaList

        p = jobs[0].params
        assert p is not None
        ids, mask = self._left_pad([j.ids for j in jobs])
        stops = p.stop_list()
        kwargs: dict[str, Any] = {
            "max_new_tokens": p.max_new_tokens,
            "pad_token_id": self.tokenizer.eos_token_ids[0],
            "eos_token_id": list(self.tokenizer.eos_token_ids),
        }
        if p.ignore_eos:
            kwargs["min_new_tokens"] = p.max_new_tokens
        elif p.min_new_tokens:
            kwargs["min_new_tokens"] = p.min_new_tokens
        if p.temperature and p.temperature > 1e-5:
            kwargs.update(do_sample=True, temperature=p.temperature, top_p=p.top_p)
            kwargs["top_k"] = p.top_k if p.top_k and p.top_k > 0 else 0
        else:
            kwargs["do_sample"] = False
        if stops:
            kwargs["stopping_criteria"] = StoppingCriteriaList(
                [_StopStrings(self.tokenizer, stops, ids.shape[1])]
            )
        out = self.model.generate(ids, attention_mask=mask, **kwargs)
        results = []
        eos = set(self.tokenizer.eos_token_ids)
        for row in out[:, ids.shape[1] :].tolist():
            reason = "length"
            for k, t in enumerate(row):
                if t in eos:
                    row, reason = row[:k], "stop"
                    break
            text = self.tokenizer.decode(row)
            cut = _cut_at_stop(text, stops)
            if cut is not None:
                text, reason = cut, "stop"
            results.append((text, len(row), reason))
        return results

    def _score(self, jobs: list[_Job]) -> list[list[list[Any]]]:
        import torch

        ids, mask = self._left_pad([j.ids for j in jobs])
        width = ids.shape[1]
        keep = max(len(j.ids) - j.start for j in jobs) + 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=keep
        ).logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        results = []
        for i, job in enumerate(jobs):
            n = len(job.ids)
            entries = []
            for t in range(job.start, n):  # token t is predicted at sequence position t - 1
                col = (width - n + t - 1) - (width - keep)
                tid = job.ids[t]
                text = self.tokenizer.decode([tid], skip_special_tokens=False)
                entries.append([float(logprobs[i, col, tid]), tid, text])
            results.append(entries)
        return results


class _StopStrings:
    """A stopping criterion: a row is done once its generated text contains a stop string."""

    def __init__(self, tokenizer: Any, stops: list[str], prompt_width: int) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.width = prompt_width

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        done = [
            _cut_at_stop(self.tokenizer.decode(row[self.width :].tolist()), self.stops) is not None
            for row in input_ids
        ]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def _cut_at_stop(text: str, stops: list[str]) -> str | None:
    """`text` up to its first stop string, or None when it has none."""
    hits = [text.find(s) for s in stops if s and s in text]
    return text[: min(hits)] if hits else None


class HFSystem(System):
    """transformers `generate` on the default GGUF (dequantized), micro-batched."""

    name = "transformers"

    def __init__(self, dtype: str = "auto", threads: int | None = None) -> None:
        super().__init__()
        self.dtype = dtype
        self.threads = threads or default_threads()
        self.resolved_dtype = ""
        self.batch_sizes: dict[str, float] = {}  # workload -> mean rows per model call

    def start(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from sglite.runtime.model.load_options import cpu_has_native_bf16
        from sglite.runtime.model.loader import default_model_path, load_tokenizer

        torch.set_num_threads(self.threads)
        dtype = self.dtype
        if dtype == "auto":  # sglite's own rule, so both compute in the same dtype
            dtype = "bfloat16" if cpu_has_native_bf16() else "float32"
        self.resolved_dtype = dtype
        path = default_model_path()
        folder, fname = os.path.split(path)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=fname, dtype=getattr(torch, dtype)
        ).eval()
        self.backend = HFBackend(model, load_tokenizer(path), path)
        self.description = f"transformers generate ({dtype}, {self.threads} threads)"

    def stop(self) -> None:
        if self.backend is not None:
            self.backend.shutdown()
            self.backend = None
            gc.collect()

    def instrument(self, log: CallLog) -> None:
        self.backend.log = log

    def run(self, workload: Any, num_requests: int, seed: int = 0) -> Any:
        b = self.backend
        before = (b.unconstrained_calls, b.forward_calls, b.forward_rows)
        row = super().run(workload, num_requests, seed)
        calls, rows = b.forward_calls - before[1], b.forward_rows - before[2]
        self.batch_sizes[workload.name] = rows / max(1, calls)
        n = b.unconstrained_calls - before[0]
        if n:
            self.notes.append(
                f"{workload.name}: {n} regex/JSON-schema generations ran unconstrained "
                "(transformers has no constrained decoding)"
            )
        return row
