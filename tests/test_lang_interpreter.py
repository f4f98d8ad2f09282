"""The language's interpreter, tracer and templates against a scripted backend (no model).

`FakeBackend` speaks the native protocol with one token per character, so every request the
interpreter makes is recorded and every answer is predictable. The real backends are exercised
in test_lang_backends.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest

import sglite as sgl
from sglite.lang.backend.base import NativeBackend, _choice_entries
from sglite.lang.chat_template import from_jinja, get_chat_template, get_chat_template_by_model_path
from sglite.lang.choices import (
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from sglite.lang.ir import SglConstantText, SglFork, SglGen, SglSelect
from sglite.lang.sampling_params import REGEX_INT
from sglite.lang.tracer import extract_prefix_by_tracing


def char_logprob(c: str) -> float:
    """The fake model's logprob of a character: letters late in the alphabet are less likely."""
    return -((ord(c) % 13) + 1) / 10


class FakeBackend(NativeBackend):
    """A native-protocol backend where each character is a token.

    A generation answers `reply` (or `[<k chars of prompt>]`), truncated to `max_new_tokens`
    characters; `delay` seconds per request; `fail_on` makes requests whose text contains it
    fail; `refuse_regex` refuses regex/json_schema like the current runtime. Every payload is
    recorded in `payloads`. `gate` (an Event) holds every request until it is set; requests
    whose text contains `rendezvous[0]` wait for each other at the barrier `rendezvous[1]`
    (which breaks after 10 s, failing them, unless enough run at once); `answered` counts
    the requests answered.
    """

    def __init__(self, reply: str | None = None, delay: float = 0.0, template: str = "chatml"):
        super().__init__()
        self.reply = reply
        self.delay = delay
        self.fail_on: str | None = None
        self.refuse_regex = False
        self.payloads: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.chat_template = get_chat_template(template)
        self.gate: threading.Event | None = None
        self.rendezvous: tuple[str, threading.Barrier] | None = None
        self.answered = 0

    def get_model_name(self) -> str:
        return "fake"

    def _answer(self, text: str, params: dict[str, Any], payload: dict[str, Any]) -> dict:
        if self.fail_on and self.fail_on in text:
            raise ValueError(f"fake failure on {self.fail_on!r}")
        max_new = params.get("max_new_tokens", 128)
        out = self.reply if self.reply is not None else f"[{len(text)}]"
        out = out[:max_new]
        for stop in params.get("stop", []):
            if stop in out:
                out = out[: out.index(stop)]
        meta: dict[str, Any] = {"prompt_tokens": len(text), "cached_tokens": 0}
        if payload.get("return_logprob"):
            start = payload.get("logprob_start_len", 0)
            meta["input_token_logprobs"] = [
                [None if i == 0 else char_logprob(text[i]), ord(text[i]), text[i]]
                for i in range(max(start, 0), len(text))
            ]
            meta["output_token_logprobs"] = []
        return {"text": out, "output_ids": [ord(c) for c in out], "meta_info": meta}

    def _request(self, payload: dict[str, Any]) -> Any:
        with self.lock:
            self.payloads.append(json.loads(json.dumps(payload)))
        if self.delay:
            time.sleep(self.delay)
        if self.gate is not None:
            self.gate.wait(timeout=30)
        text = payload.get("text")
        if self.rendezvous and isinstance(text, str) and self.rendezvous[0] in text:
            self.rendezvous[1].wait(timeout=10)
        with self.lock:
            self.answered += 1
        params = payload.get("sampling_params", {})
        if self.refuse_regex and (params.get("regex") or params.get("json_schema")):
            raise ValueError("regex: constrained decoding is not supported yet")
        if "input_ids" in payload:
            texts = ["".join(chr(i) for i in ids) for ids in payload["input_ids"]]
            return [self._answer(t, params, {**payload, "logprob_start_len": 0}) for t in texts]
        text = payload["text"]
        if isinstance(text, list):
            return [self._answer(t, params, payload) for t in text]
        if params.get("n", 1) > 1:
            return [self._answer(text, params, payload) for _ in range(params["n"])]
        return self._answer(text, params, payload)

    def _request_stream(self, payload: dict[str, Any]):
        full = self._request({k: v for k, v in payload.items() if k != "stream"})
        for i in range(1, len(full["text"]) + 1):
            time.sleep(0.02)  # let the reader see the chunks one by one
            yield {"text": full["text"][:i], "meta_info": full["meta_info"]}

    def flush_cache(self) -> bool:
        return True

    def get_server_info(self) -> dict[str, Any]:
        return {"cache_hit_rate": 0.5}


def gens(backend: FakeBackend) -> list[dict[str, Any]]:
    """Payloads of generation requests (not prefill-only or scoring ones)."""
    return [
        p
        for p in backend.payloads
        if isinstance(p.get("text"), str) and p["sampling_params"].get("max_new_tokens") != 0
    ]


# ---------------------------------------------------------------------------- basics
def test_gen_is_asynchronous_and_reading_waits():
    backend = FakeBackend(reply="ok")
    backend.gate = threading.Event()

    @sgl.function
    def prog(s):
        s += "Hi"
        s += sgl.gen("a", max_tokens=4)
        s["answered_at_submit"] = backend.answered  # += returned with the request held
        backend.gate.set()

    state = prog.run(backend=backend)
    assert state["answered_at_submit"] == 0
    assert state["a"] == "ok"
    assert state.text() == "Hiok"


def test_expressions_run_in_order_and_see_earlier_text():
    backend = FakeBackend()

    @sgl.function
    def prog(s, name):
        s += "Hello " + name + "."
        s += sgl.gen("first", max_tokens=8)
        s += " and "
        s += sgl.gen("second", max_tokens=8)

    state = prog.run(name="Bob", backend=backend)
    assert state["first"] == "[10]"  # "Hello Bob." is 10 characters
    assert state["second"] == "[19]"  # "Hello Bob.[10] and "
    assert state.text() == "Hello Bob.[10] and [19]"
    assert "first" in state and "missing" not in state
    assert state.get_meta_info("first")["prompt_tokens"] == 10
    assert state.error() is None


def test_run_defaults_and_gen_overrides_reach_the_request():
    backend = FakeBackend(reply="x")

    @sgl.function
    def prog(s):
        s += "P"
        s += sgl.gen(
            "a", max_tokens=5, min_tokens=1, stop=["\n"], stop_token_ids=[7], top_p=0.9,
            top_k=20, min_p=0.05, frequency_penalty=0.1, presence_penalty=0.2, ignore_eos=True,
            return_logprob=True, logprob_start_len=0, top_logprobs_num=2,
            return_text_in_logprobs=True, regex="[a-z]+",
        )  # fmt: skip
        s += sgl.gen("b", json_schema={"type": "object"})

    prog.run(backend=backend, temperature=0, max_new_tokens=9, stop="END").sync()
    first, second = gens(backend)
    assert first["sampling_params"] == {
        "max_new_tokens": 5, "min_new_tokens": 1, "stop": ["\n"], "stop_token_ids": [7],
        "temperature": 0, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "frequency_penalty": 0.1,
        "presence_penalty": 0.2, "ignore_eos": True, "regex": "[a-z]+",
    }  # fmt: skip
    assert first["return_logprob"] is True and first["logprob_start_len"] == 0
    assert first["top_logprobs_num"] == 2 and first["return_text_in_logprobs"] is True
    assert second["sampling_params"]["max_new_tokens"] == 9  # the run's default
    assert second["sampling_params"]["stop"] == ["END"]
    assert json.loads(second["sampling_params"]["json_schema"]) == {"type": "object"}


def test_gen_n_returns_a_list_and_text_continues_with_the_first():
    backend = FakeBackend(reply="ab")

    @sgl.function
    def prog(s):
        s += "Q"
        s += sgl.gen("many", n=3, max_tokens=2)

    state = prog.run(backend=backend)
    assert state["many"] == ["ab", "ab", "ab"]
    assert len(state.get_meta_info("many")) == 3
    assert state.text() == "Qab"


def test_gen_int_uses_the_int_regex_and_falls_back_when_constraints_are_refused():
    backend = FakeBackend(reply="42 apples")
    backend.refuse_regex = True

    @sgl.function
    def prog(s):
        s += "Count:"
        s += sgl.gen_int("n", max_tokens=8)
        s += sgl.gen_string("t", max_tokens=8)

    with pytest.warns(UserWarning, match="constrained decoding"):
        state = prog.run(backend=backend)
        assert state["n"] == "42"  # stopped at the space dtype=int adds
    assert state.error() is None
    asked = gens(backend)
    assert asked[0]["sampling_params"]["regex"] == REGEX_INT
    assert " " in asked[0]["sampling_params"]["stop"]
    assert all("regex" not in p["sampling_params"] for p in asked[1:])  # learnt: not supported


def test_explicit_regex_is_not_dropped_when_refused():
    backend = FakeBackend(reply="x")
    backend.refuse_regex = True

    @sgl.function
    def prog(s):
        s += "A"
        s += sgl.gen("a", regex="[0-9]+")

    state = prog.run(backend=backend)
    assert "constrained decoding is not supported" in str(state.error())


def test_bad_regex_fails_where_it_is_written():
    with pytest.raises(Exception):  # noqa: B017 - re.error
        sgl.gen("a", regex="[unclosed")


def test_first_argument_must_be_s():
    with pytest.raises(TypeError, match="'s'"):

        @sgl.function
        def prog(state):
            pass


def test_bind_and_positional_batch_arguments():
    backend = FakeBackend(reply="")

    @sgl.function
    def prog(s, a, b="B"):
        s += a + b

    bound = prog.bind(b="X")
    assert bound.run("a", backend=backend).text() == "aX"
    states = prog.run_batch([("1",), ("2", "3")], backend=backend)
    assert [st.text() for st in states] == ["1B", "23"]
    with pytest.raises(TypeError):
        prog.bind(c=1)


# ---------------------------------------------------------------------------- roles
def test_roles_render_with_the_template_and_build_messages():
    backend = FakeBackend(reply="hi there", template="qwen")  # qwen has a default system prompt

    @sgl.function
    def chat(s):
        s += sgl.user("Hello")
        s += sgl.assistant(sgl.gen("a1", max_tokens=16))
        with s.user():
            s += "Again"
        s += sgl.assistant_begin()
        s += sgl.gen("a2", max_tokens=16)
        s += sgl.assistant_end()

    state = chat.run(backend=backend)
    assert state.text() == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nhi there<|im_end|>\n"
        "<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\nhi there<|im_end|>\n"
    )
    assert state.messages() == [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "hi there"},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "hi there"},
    ]


def test_template_stop_string_is_added_only_inside_assistant_turns():
    backend = FakeBackend(reply="x")

    @sgl.function
    def prog(s):
        s += sgl.user(sgl.gen("in_user", max_tokens=2, stop="."))
        s += sgl.assistant(sgl.gen("in_assistant", max_tokens=2, stop="."))
        s += sgl.gen("outside", max_tokens=2)

    prog.run(backend=backend).sync()
    stops = [p["sampling_params"].get("stop", []) for p in gens(backend)]
    assert stops == [["."], [".", "<|im_end|>"], []]


def test_nested_roles_are_rejected_where_they_are_written():
    backend = FakeBackend()

    @sgl.function
    def nested(s):
        with s.user():
            s += sgl.assistant("oops")

    with pytest.raises(ValueError, match="Nested roles are not allowed"):
        nested.run(backend=backend)

    @sgl.function
    def unbalanced(s):
        s += sgl.user_begin()
        s += sgl.assistant_end()

    with pytest.raises(ValueError, match="cannot end a 'assistant' turn"):
        unbalanced.run(backend=backend)

    # In a batch the same mistake is that program's error, not the batch's.
    states = nested.run_batch([{}, {}], backend=backend)
    assert all(isinstance(st.error(), ValueError) for st in states)


# ---------------------------------------------------------------------------- state tools
def test_var_scope_copy_set_var_and_contains():
    backend = FakeBackend(reply="G")

    @sgl.function
    def prog(s):
        s += "a"
        with s.var_scope("scoped"):
            s += "b" + sgl.gen("g", max_tokens=1) + "c"
        with s.copy() as branch:
            branch += sgl.gen("in_copy", max_tokens=1)
        s["manual"] = 5

    state = prog.run(backend=backend)
    assert state["scoped"] == "bGc"
    assert state.text() == "abGc"  # the copy's text stays in the copy
    assert state["in_copy"] == ["G"]  # gathered from the one branch
    assert state["manual"] == 5 and "manual" in state


def test_fork_commits_the_prefix_then_branches_run_in_parallel():
    backend = FakeBackend(reply="b")
    # The three branches' requests can only be answered while all three are in flight.
    backend.rendezvous = ("#", threading.Barrier(3))

    @sgl.function
    def prog(s):
        s += "Question."
        forks = s.fork(3)
        forks += lambda i: f"#{i}:"
        forks += sgl.gen("ans", max_tokens=1)
        forks.join()
        s += "|" + sgl.gen("after", max_tokens=1)

    state = prog.run(backend=backend)
    assert state["ans"] == ["b", "b", "b"]
    assert state.text() == "Question.|b"
    first = backend.payloads[0]
    assert first == {"text": "Question.", "sampling_params": {"max_new_tokens": 0}}
    branch_texts = sorted(p["text"] for p in gens(backend)[:3])
    assert branch_texts == ["Question.#0:", "Question.#1:", "Question.#2:"]


def test_join_concate_and_append_appends_branch_text_in_order():
    backend = FakeBackend(reply="x")

    @sgl.function
    def prog(s):
        s += "Start:"
        forks = s.fork(2)
        forks[0] += " one" + sgl.gen("v", max_tokens=1)
        forks[1] += " two" + sgl.gen("v", max_tokens=1)
        forks.join("concate_and_append")

    state = prog.run(backend=backend)
    assert state.text() == "Start: onex twox"
    # A finished run can be forked to continue from it; it cannot be appended to.
    with pytest.raises(RuntimeError, match="has ended"):
        state += "more"
    forks = state.fork(2)
    forks += sgl.gen("more", max_tokens=1)
    with pytest.raises(ValueError, match="join mode"):
        forks.join("bogus")
    forks.join()
    assert state["more"] == ["x", "x"]


# ---------------------------------------------------------------------------- errors
def test_a_failing_generation_surfaces_in_error_and_releases_waiters():
    backend = FakeBackend(reply="x")
    backend.fail_on = "BOOM"

    @sgl.function
    def prog(s):
        s += "BOOM"
        s += sgl.gen("a", max_tokens=1)
        s += sgl.gen("b", max_tokens=1)  # skipped after the error, but never blocks

    state = prog.run(backend=backend)
    assert isinstance(state.error(), ValueError)
    with pytest.raises(RuntimeError, match="was not produced"):
        state["b"]
    assert len(gens(backend)) == 1


def test_run_batch_keeps_order_and_isolates_errors():
    backend = FakeBackend()
    backend.fail_on = "bad-backend"

    @sgl.function
    def prog(s, tag):
        if tag == "bad-body":
            raise KeyError("in the body")
        s += tag + ":"
        s += sgl.gen("out", max_tokens=8)

    tags = ["a", "bad-backend", "bb", "bad-body", "ccc"]
    states = prog.run_batch([{"tag": t} for t in tags], backend=backend, num_threads=3)
    assert [st.text().split(":")[0] for st in states if st.error() is None] == ["a", "bb", "ccc"]
    assert isinstance(states[1].error(), ValueError)
    assert isinstance(states[3].error(), KeyError)
    assert states[4]["out"] == "[4]"
    gen_style = list(prog.run_batch([{"tag": "z"}], backend=backend, generator_style=True))
    assert gen_style[0]["out"] == "[2]"


def test_run_batch_progress_bar(capsys):
    backend = FakeBackend(reply="")

    @sgl.function
    def prog(s, x):
        s += x

    prog.run_batch([{"x": "1"}, {"x": "2"}], backend=backend, progress_bar=True)
    assert "2/2" in capsys.readouterr().err


# ---------------------------------------------------------------------------- streaming
def test_streaming_yields_the_same_text_as_a_normal_run():
    backend = FakeBackend(reply="abcdef")

    @sgl.function
    def prog(s):
        s += "P:"
        s += sgl.gen("a", max_tokens=6)
        s += sgl.select("c", choices=["x", "y"])

    normal = prog.run(backend=backend).text()
    state = prog.run(backend=backend, stream=True)
    chunks = list(state.text_iter())
    assert "".join(chunks) == normal and len(chunks) > 2
    state = prog.run(backend=backend, stream=True)
    assert "".join(state.text_iter("a")) == "abcdef"

    async def collect() -> str:
        st = prog.run(backend=backend, stream=True)
        return "".join([c async for c in st.text_async_iter()])

    assert asyncio.run(collect()) == normal
    # Without stream=True the iterator yields the final text once.
    assert list(prog.run(backend=backend).text_iter()) == [normal]


# ---------------------------------------------------------------------------- select
def test_select_scores_only_the_choice_tokens():
    backend = FakeBackend()

    @sgl.function
    def prog(s):
        s += "Pick:"
        s += sgl.select("tl", choices=["az", "bb", "m"])
        s += sgl.select("greedy", choices=["az", "bb"], choices_method=greedy_token_selection)
        s += sgl.select(
            "uncond", choices=["az", "bb"], choices_method=unconditional_likelihood_normalized
        )

    state = prog.run(backend=backend)
    mean = {c: sum(char_logprob(x) for x in c) / len(c) for c in ["az", "bb", "m"]}
    assert state["tl"] == max(mean, key=mean.get)
    scores = state.get_meta_info("tl")["normalized_prompt_logprobs"]
    assert scores == pytest.approx([mean["az"], mean["bb"], mean["m"]])
    # greedy: first tokens 'a' vs 'b' decide.
    assert state["greedy"] == ("az" if char_logprob("a") > char_logprob("b") else "bb")
    # unconditional: the first unconditional token counts 0, the rest cancel out.
    uncond = {c: char_logprob(c[0]) / len(c) for c in ["az", "bb"]}
    assert state["uncond"] == max(uncond, key=uncond.get)
    with pytest.raises(ValueError):
        sgl.select("x", choices=[])


def test_choice_entries_include_the_boundary_token_only_when_it_was_retokenized():
    entries = [[None, 1, "a"], [-1.0, 2, " b"], [-2.0, 3, " yes"]]
    assert _choice_entries(entries, 2, " yes") == [[-2.0, 3, " yes"]]
    healed = [[None, 1, "a"], [-1.0, 2, ":"], [-3.0, 4, " yes"]]  # prefix "a: " + "yes"
    assert _choice_entries(healed, 2, "yes") == [[-1.0, 2, ":"], [-3.0, 4, " yes"]]


def test_choice_methods():
    kwargs = dict(
        choices=["a", "b"],
        normalized_prompt_logprobs=[-1.0, -0.5],
        input_token_logprobs=[[[-1.0, 1, "a"]], [[-0.2, 2, "b"], [-0.8, 3, "c"]]],
        output_token_logprobs=[[], []],
    )
    assert token_length_normalized(**kwargs).decision == "b"
    greedy = greedy_token_selection(**kwargs)
    assert greedy.decision == "b" and greedy.meta_info["greedy_logprob_matrix"][0] == [-1.0, -1.0]
    unconditional = [[[None, 1, None]], [[None, 2, None], [-0.1, 3, None]]]
    method = unconditional_likelihood_normalized
    uncond = method(**kwargs, unconditional_token_logprobs=unconditional)
    assert uncond.meta_info["normalized_unconditional_prompt_logprobs"] == pytest.approx(
        [-1.0, (-0.2 + -0.7) / 2]
    )


# ---------------------------------------------------------------------------- tracing
FEW_SHOT = "Q: 1+1?\nA: 2\nQ: 2+2?\nA: 4\nQ: 3+3?\nA: 6\nQ: 4+4?\nA: 8\nQ: 5+5?\nA: 10\n"


@sgl.function
def traced_qa(s, question):
    s += FEW_SHOT
    s += "Q: " + question + "\nA:"
    s += sgl.gen("answer", max_tokens=4)
    forks = s.fork(2)
    forks += sgl.select("ok", choices=["yes", "no"])
    forks.join()


def test_trace_builds_the_graph():
    backend = FakeBackend()
    tracer = traced_qa.trace(backend=backend)
    nodes = tracer.flatten_nodes()
    assert isinstance(nodes[0], SglConstantText) and nodes[0].value == FEW_SHOT
    assert any(isinstance(n, SglGen) and n.name == "answer" for n in nodes)
    assert len(tracer.child_states) == 2  # the two branches
    branch_nodes = tracer.child_states[0].flatten_nodes()
    assert isinstance(branch_nodes[0], SglSelect)
    assert isinstance(branch_nodes[0].prev_node.prev_node, SglFork)
    assert "Gen('answer')" in tracer.last_node.print_graph_dfs()
    assert isinstance(tracer.variables["ok"], list)  # gathered by the traced join


def test_prefix_extraction_and_run_batch_precache():
    backend = FakeBackend(reply="")
    assert extract_prefix_by_tracing(traced_qa, backend) == FEW_SHOT + "Q: "

    @sgl.function
    def fstring(s, name):
        s += FEW_SHOT
        s += f"Hello {name}"  # placeholders refuse formatting: the prefix ends here

    assert extract_prefix_by_tracing(fstring, backend) == FEW_SHOT
    traced_qa.run_batch([{"question": "6+6?"}, {"question": "7+7?"}], backend=backend)
    assert backend.payloads[0] == {
        "text": FEW_SHOT + "Q: ",
        "sampling_params": {"max_new_tokens": 0},
    }


def test_default_backend_helpers():
    backend = FakeBackend(reply="d")
    old = sgl.global_config.default_backend
    try:
        sgl.set_default_backend(backend)

        @sgl.function
        def prog(s):
            s += sgl.gen("x", max_tokens=1)

        assert prog()["x"] == "d"  # calling the function runs it
        assert sgl.flush_cache() is True
        assert sgl.get_server_info() == {"cache_hit_rate": 0.5}
        sgl.set_default_backend(None)
        assert sgl.flush_cache() is False
        with pytest.raises(ValueError, match="no backend"):
            prog.run()
    finally:
        sgl.global_config.default_backend = old


# ---------------------------------------------------------------------------- templates
def test_named_templates_chosen_from_model_path():
    assert get_chat_template_by_model_path("meta-llama/Llama-3-8B-Instruct").name == (
        "llama-3-instruct"
    )
    assert get_chat_template_by_model_path("Qwen/Qwen2-7B-Instruct").name == "qwen"
    assert get_chat_template_by_model_path("x/SmolLM2-135M-Instruct.Q4_1.gguf").name == "chatml"
    assert get_chat_template_by_model_path("some/base-model").name == "default"


def test_jinja_template_reduction_matches_the_renderer():
    import jinja2

    # A Llama-3 style template printing BOS itself, without a default system prompt.
    source = (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
        "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    )
    template = jinja2.Environment().from_string(source)

    def render(messages, add_generation_prompt):
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token="<BOS>"
        )

    chat = from_jinja(render)
    assert chat.doc_start == "<BOS>"
    assert chat.default_system_prompt is None
    assert chat.stop_str == ("<|eot_id|>",)
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"},
    ]
    assert chat.get_prompt(msgs) == render(msgs, False)


def test_smollm2_template_from_the_gguf_tokenizer():
    from sglite.lang.chat_template import from_tokenizer
    from sglite.runtime.model.loader import load_tokenizer

    tokenizer = load_tokenizer(None)
    chat = from_tokenizer(tokenizer, "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert chat.source == "jinja"
    assert chat.stop_str == ("<|im_end|>",)
    assert chat.default_system_prompt.startswith("You are a helpful AI assistant named SmolLM")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    expected = tokenizer.apply_chat_template(msgs, add_generation_prompt=False)
    assert chat.get_prompt([{"role": "system", "content": None}, *msgs]) == expected
