"""`sgl.OpenAI` and API speculative execution (`@sgl.function(num_api_spec_tokens=N)`).

Two halves:
- a scripted OpenAI client (`FakeClient`: one token per character, a model that can only
  recite `WORLD`), to pin the speculation rules down exactly and fast;
- the real `openai` client against the session's `sglite serve` (`sglite_server`, its `/v1`
  API), greedy and a few tokens per gen: speculation makes fewer calls and sends fewer prompt
  tokens with the same values, chat turns take one call when the reply matches and fall back
  correctly when it does not, usage equals the server's own counters, and select, streaming
  and constraints work over the API.
"""

from __future__ import annotations

import json
import re
import time
from types import SimpleNamespace
from typing import Any

import pytest
import requests

import sglite as sgl
from sglite.lang.backend.api_select import select_by_logit_bias
from sglite.lang.backend.api_speculative_chat import _Gen, _Text, match_turn
from sglite.lang.backend.api_speculative_reply import SpecReply, find_cut, token_ends_from_pieces
from sglite.lang.ir import SglGen
from sglite.lang.sampling_params import SglSamplingParams

MODEL = "SmolLM2-135M-Instruct"


# ============================================================================ a scripted client
WORLD = "Name: Ann Lee\nAge: 30\nJob: cook\nHobby: chess\nCity: Rome\n"
HEADER = "Profiles.\n"


def recite(prompt: str, max_tokens: int) -> tuple[str, str]:
    """The fake model: after a prefix of HEADER + WORLD it recites the rest and ends; after
    anything else it writes '?' forever. One token per character."""
    full = HEADER + WORLD
    if full.startswith(prompt):
        rest = full[len(prompt) :]
        return (rest, "stop") if len(rest) <= max_tokens else (rest[:max_tokens], "length")
    return "?" * max_tokens, "length"


def _apply_stop(text: str, reason: str, stop: Any) -> tuple[str, str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    cuts = [text.find(x) for x in stops if x in text]
    return (text[: min(cuts)], "stop") if cuts else (text, reason)


class FakeCompletions:
    """`client.completions` / `client.chat.completions` of the scripted model."""

    def __init__(self, client: FakeClient, chat: bool) -> None:
        self.client, self.chat = client, chat

    def create(self, **kw: Any) -> Any:
        self.client.requests.append(kw)
        if self.chat:
            messages = kw["messages"]
            partial = ""
            if kw.get("extra_body", {}).get("continue_final_message"):
                partial = messages[-1]["content"]
            prompt = HEADER + partial  # the chat model recites WORLD as its answer
            prompt_tokens = sum(len(m["content"]) for m in messages)
        else:
            prompt, prompt_tokens = kw["prompt"], len(kw["prompt"])
        text, reason = recite(prompt, kw.get("max_tokens", 16))
        text, reason = _apply_stop(text, reason, kw.get("stop"))
        logprobs = None
        if kw.get("logprobs") is not None and kw.get("logprobs") is not False:
            if self.chat:
                logprobs = SimpleNamespace(
                    content=[SimpleNamespace(token=c, logprob=-0.1, top_logprobs=[]) for c in text]
                )
            else:
                logprobs = SimpleNamespace(
                    tokens=list(text), token_logprobs=[-0.1] * len(text), top_logprobs=None
                )
        choice = SimpleNamespace(index=0, finish_reason=reason, logprobs=logprobs)
        if self.chat:
            choice.message = SimpleNamespace(content=text)
        else:
            choice.text = text
        usage = SimpleNamespace(
            prompt_tokens=prompt_tokens, completion_tokens=len(text), prompt_tokens_details=None
        )
        return SimpleNamespace(id="fake", choices=[choice], usage=usage)


class FakeClient:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.completions = FakeCompletions(self, chat=False)
        self.chat = SimpleNamespace(completions=FakeCompletions(self, chat=True))


def fake_backend(chat: bool = False, **kwargs: Any) -> sgl.OpenAI:
    return sgl.OpenAI("fake", client=FakeClient(), is_chat_model=chat, **kwargs)


FIELDS = ["Name", "Age", "Job", "Hobby", "City"]


def fake_profile(spec: int | None, labels: list[str] | None = None, max_tokens: int = 12):
    labels = labels or FIELDS

    @sgl.function(num_api_spec_tokens=spec)
    def profile(s):
        s += HEADER
        for i, label in enumerate(labels):
            s += ("" if i == 0 else "\n") + label + ":"
            s += sgl.gen(FIELDS[i].lower(), max_tokens=max_tokens, stop="\n")

    return profile


def values(state, names=None) -> dict[str, str]:
    return {k: state[k] for k in (names or [f.lower() for f in FIELDS])}


# ---------------------------------------------------------------------------- pure rules
def test_find_cut_stops_token_limits_and_the_models_end():
    text = "ab\ncd\nef"
    ends = token_ends_from_pieces(text, ["ab", "\nc", "d", "\n", "ef"])
    assert ends == [2, 4, 5, 6, 8]
    reply = SpecReply(text, finished=False, token_ends=ends, max_tokens=5)
    cut = find_cut(reply, 0, ["\n"], 4)
    assert (cut.end, cut.finish_reason, cut.matched, cut.num_tokens) == (2, "stop", "\n", 1)
    # The stop completes in the 2nd token; with max_tokens=1 the gen is cut by length first.
    cut = find_cut(reply, 0, ["\n"], 1)
    assert (cut.end, cut.finish_reason) == (2, "length")
    # The stop string completed first wins: "d\n" completes at 6, "\nef" at 8.
    assert find_cut(reply, 3, ["\nef", "d\n"], 9).end == 4
    # No stop in the rest and fewer tokens than asked: the reply does not tell.
    assert find_cut(reply, 6, ["\n"], 4) is None
    # ... unless the model ended there itself.
    done = SpecReply(text, finished=True, token_ends=ends, max_tokens=5)
    assert find_cut(done, 6, ["\n"], 4).end == len(text)
    # Pieces that do not spell the text (byte tokens) mean "unknown".
    assert token_ends_from_pieces("é", ["\\xc3", "\\xa9"]) is None


def test_match_turn_accepts_the_longest_matching_prefix():
    params = SglSamplingParams(max_new_tokens=8, stop=["\n"])
    g1, g2 = _Gen(SglGen("a"), params), _Gen(SglGen("b"), params)
    items = [_Text("A:"), g1, _Text("\nB:"), g2]
    reply = SpecReply("A: 1\nB: 2\nC: 3", finished=False, token_ends=None, max_tokens=32)
    turn = match_turn(reply, items)
    assert turn.accepted == 4
    assert [reply.text[c.start : c.end] for c in turn.cuts.values()] == [" 1", " 2"]
    other = SpecReply("A: 1\nX: 2", finished=False, token_ends=None, max_tokens=32)
    assert match_turn(other, items).accepted == 2  # "\nB:" does not match


# ---------------------------------------------------------------------------- completion path
def test_completion_speculation_serves_later_gens_without_calls():
    plain, spec = fake_backend(), fake_backend()
    expected = fake_profile(None).run(backend=plain, temperature=0)
    state = fake_profile(64).run(backend=spec, temperature=0)
    assert state.error() is None
    assert values(state) == values(expected) == {
        "name": " Ann Lee", "age": " 30", "job": " cook", "hobby": " chess", "city": " Rome"
    }  # fmt: skip
    assert state.text() == expected.text()
    assert plain.token_usage.num_calls == 5
    assert spec.token_usage.num_calls == 1
    request = spec.client.requests[0]
    assert "stop" not in request and request["max_tokens"] == 64 and request["logprobs"] == 0
    assert state.get_meta_info("name")["api_call"] is True
    assert state.get_meta_info("age") == {
        "finish_reason": {"type": "stop", "matched": "\n"},
        "completion_tokens": 3,
        "speculative": True,
        "api_call": False,
    }


def test_completion_speculation_drops_on_mismatch_and_limits():
    # "Work:" is not what the model wrote: the speculation is dropped and the next gen calls.
    labels = ["Name", "Age", "Work", "Hobby", "City"]
    plain, spec = fake_backend(), fake_backend()
    expected = fake_profile(None, labels).run(backend=plain, temperature=0)
    state = fake_profile(64, labels).run(backend=spec, temperature=0)
    assert values(state) == values(expected)
    assert state["job"] == "?" * 12 and state["hobby"] == "?" * 12
    assert spec.token_usage.num_calls == 4  # name (age served), job, hobby, city
    # A speculation shorter than the whole profile: a new call where it runs out.
    small = fake_backend()
    state = fake_profile(20).run(backend=small, temperature=0)
    assert values(state) == values(expected, ["name", "age"]) | {
        "job": " cook", "hobby": " chess", "city": " Rome"
    }  # fmt: skip
    assert small.token_usage.num_calls == 3
    # max_tokens cuts a served gen exactly where its own request would have stopped.
    state = fake_profile(64, max_tokens=3).run(backend=fake_backend(), temperature=0)
    assert values(state) == values(fake_profile(None, max_tokens=3).run(backend=fake_backend()))
    assert state["name"] == " An"


def test_unspeculable_gens_run_as_usual():
    backend = fake_backend()

    @sgl.function(num_api_spec_tokens=64)
    def prog(s):
        s += HEADER + "Name:"
        s += sgl.gen("name", max_tokens=12, stop="\n", frequency_penalty=0.5)
        s += "\nAge:" + sgl.gen("age", max_tokens=12, stop="\n")

    state = prog.run(backend=backend, temperature=0)
    assert (state["name"], state["age"]) == (" Ann Lee", " 30")
    assert backend.client.requests[0]["stop"] == ["\n"]  # a normal request
    assert "stop" not in backend.client.requests[1]


# ---------------------------------------------------------------------------- chat path
def fake_chat_profile(spec: int | None, labels: list[str] | None = None, turns: int = 1):
    labels = labels or FIELDS

    @sgl.function(num_api_spec_tokens=spec)
    def profile(s):
        for t in range(turns):
            s += sgl.user(f"Profile {t}, please.")
            with s.assistant():
                for i, label in enumerate(labels):
                    s += ("" if i == 0 else "\n") + label + ":"
                    s += sgl.gen(f"{FIELDS[i].lower()}{t}", max_tokens=12, stop="\n")

    return profile


def test_chat_turn_is_one_call_when_the_reply_matches():
    plain, spec = fake_backend(chat=True), fake_backend(chat=True)
    expected = fake_chat_profile(None, turns=2).run(backend=plain, temperature=0)
    state = fake_chat_profile(64, turns=2).run(backend=spec, temperature=0)
    names = [f"{f.lower()}{t}" for t in range(2) for f in FIELDS]
    assert values(state, names) == values(expected, names)
    assert state["city1"] == " Rome"
    assert state.messages() == expected.messages()
    assert plain.token_usage.num_calls == 10
    assert spec.token_usage.num_calls == 2  # one per assistant turn
    first = spec.client.requests[0]
    assert first["messages"][-1]["role"] == "user" and "stop" not in first
    # Without speculation, gens after assistant text continue the partial message.
    assert plain.client.requests[1]["extra_body"]["continue_final_message"] is True


def test_chat_mismatch_falls_back_correctly():
    labels = ["Name", "Age", "Work", "Hobby", "City"]
    expected = fake_chat_profile(None, labels).run(backend=fake_backend(chat=True), temperature=0)
    names = [f"{f.lower()}0" for f in FIELDS]
    # One try: name and age are accepted, then one call per remaining gen.
    one = fake_backend(chat=True, max_spec_tries=1)
    state = fake_chat_profile(64, labels).run(backend=one, temperature=0)
    assert values(state, names) == values(expected, names)
    assert one.token_usage.num_calls == 1 + 3
    # Default tries: after "Work:" is appended, a new call continues the partial message.
    more = fake_backend(chat=True)
    state = fake_chat_profile(64, labels).run(backend=more, temperature=0)
    assert values(state, names) == values(expected, names)
    assert state.messages() == expected.messages()
    assert more.token_usage.num_calls < 5


def test_chat_deferred_gens_run_when_read_or_at_the_end():
    backend = fake_backend(chat=True)

    @sgl.function(num_api_spec_tokens=64)
    def prog(s):
        s += sgl.user("Profile, please.")
        s += sgl.assistant_begin()
        s += "Name:" + sgl.gen("name", max_tokens=12, stop="\n")
        s += "\nAge:" + sgl.gen("age", max_tokens=12, stop="\n")
        s["seen"] = s["age"]  # reading inside the open turn must not wait forever
        s += "\nJob:" + sgl.gen("job", max_tokens=12, stop="\n")
        # the turn is never closed: the program's end runs what is deferred

    state = prog.run(backend=backend, temperature=0)
    assert (state["seen"], state["job"]) == (" 30", " cook")
    assert state.text().endswith("Job: cook")

    @sgl.function(num_api_spec_tokens=64)
    def branches(s):
        s += sgl.user("Profile, please.")
        forks = s.fork(2)
        for f in forks:  # each branch leaves its turn open; join still sees its variables
            f += sgl.assistant_begin() + "Name:" + sgl.gen("name", max_tokens=12, stop="\n")
            f += "\nAge:" + sgl.gen("age", max_tokens=12, stop="\n")
        forks.join()

    state = branches.run(backend=backend, temperature=0)
    assert state.error() is None
    assert state["age"] == [" 30", " 30"]


# ---------------------------------------------------------------------------- select by bias
class BiasTokenizer:
    """Words are tokens (with their leading space)."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return [self.vocab.setdefault(w, len(self.vocab)) for w in re.findall(r" ?\S+", text)]

    def decode(self, ids: list[int]) -> str:
        inverse = {v: k for k, v in self.vocab.items()}
        return "".join(inverse[i] for i in ids)


def test_select_by_logit_bias_follows_the_biased_tokens():
    tok = BiasTokenizer()
    preferred = tok.encode(" blue sky") + tok.encode(" blue sea")  # the model's preferences
    calls = []

    def complete(**kw):
        calls.append(kw)
        allowed = [int(t) for t in kw["logit_bias"]]
        best = min(allowed, key=lambda t: preferred.index(t) if t in preferred else 99)
        return SimpleNamespace(choices=[SimpleNamespace(index=0, text=tok.decode([best]))])

    choices = [" red sky", " blue sea", " blue sky"]
    decision = select_by_logit_bias(complete, tok, "The", choices)
    assert decision.decision == " blue sky"
    assert decision.meta_info["scores"] == [0, 1, 2]
    assert len(calls) == 2 and all(c["max_tokens"] == 1 for c in calls)

    # sgl.OpenAI falls back to it when the endpoint refuses echoed logprobs (once).
    class Refused(Exception):
        status_code = 400

    def create(**kw):
        if kw.get("echo"):
            calls.append("echo")
            raise Refused("echo is not supported")
        response = complete(**kw)
        response.usage = None
        return response

    client = SimpleNamespace(completions=SimpleNamespace(create=create))
    backend = sgl.OpenAI("fake", client=client, is_chat_model=False, tokenizer=tok)

    @sgl.function
    def pick(s):
        s += "The" + sgl.select("a", choices=choices) + "." + sgl.select("b", choices=choices)

    calls.clear()
    state = pick.run(backend=backend)
    assert state.error() is None and state["a"] == " blue sky"
    assert calls.count("echo") == 1 and backend.token_usage.num_calls == 4


# ============================================================================ the real server
@pytest.fixture(scope="module")
def v1(sglite_server) -> str:
    return sglite_server.url + "/v1"


def completion_backend(v1: str) -> sgl.OpenAI:
    return sgl.OpenAI(MODEL, base_url=v1, is_chat_model=False)


def chat_backend(v1: str, **kwargs: Any) -> sgl.OpenAI:
    return sgl.OpenAI(MODEL, base_url=v1, **kwargs)


PROFILES = (
    "Character profiles.\n\n"
    "Name: Alice Smith\nAge: 34\nJob: teacher\nHobby: painting\nCity: Boston\nPet: cat\n\n"
    "Name: Bob Jones\nAge: 52\nJob: baker\nHobby: fishing\nCity: Denver\nPet: dog\n\n"
)
SIX = ["name", "age", "job", "hobby", "city", "pet"]


def profile_program(spec: int | None):
    @sgl.function(num_api_spec_tokens=spec)
    def profile(s, first):
        s += PROFILES + "Name: " + first
        s += sgl.gen("name", max_tokens=8, stop="\n")
        for field in SIX[1:]:
            s += "\n" + field.capitalize() + ":" + sgl.gen(field, max_tokens=8, stop="\n")

    return profile


def test_completion_profile_fewer_calls_and_prompt_tokens_same_values(v1):
    plain, spec = completion_backend(v1), completion_backend(v1)
    expected = profile_program(None).run(first="Carol", backend=plain, temperature=0)
    state = profile_program(32).run(first="Carol", backend=spec, temperature=0)
    assert expected.error() is None and state.error() is None
    assert values(state, SIX) == values(expected, SIX)
    assert state.text() == expected.text()
    assert plain.token_usage.num_calls == 6
    assert spec.token_usage.num_calls < plain.token_usage.num_calls
    assert spec.token_usage.prompt_tokens < plain.token_usage.prompt_tokens
    # The same program on the native protocol gives the same values.
    native = profile_program(None).run(
        first="Carol", backend=sgl.RuntimeEndpoint(v1[: -len("/v1")]), temperature=0
    )
    assert values(native, SIX) == values(expected, SIX)


CHAT_EXAMPLE = "Name: Alice Smith\nAge: 34\nJob: teacher\nHobby: painting"


def chat_profile_program(spec: int | None, labels: list[str]):
    @sgl.function(num_api_spec_tokens=spec)
    def profile(s, who):
        s += sgl.user("Write a short character profile of a teacher.")
        s += sgl.assistant(CHAT_EXAMPLE)
        s += sgl.user(f"Write a short character profile of a {who}.")
        with s.assistant():
            for i, label in enumerate(labels):
                s += ("" if i == 0 else "\n") + label + ":"
                s += sgl.gen(SIX[i], max_tokens=8, stop="\n")

    return profile


def test_chat_turn_one_call_when_it_matches(v1):
    labels = ["Name", "Age", "Job", "Hobby"]
    plain, spec = chat_backend(v1), chat_backend(v1)
    expected = chat_profile_program(None, labels).run(who="baker", backend=plain, temperature=0)
    state = chat_profile_program(40, labels).run(who="baker", backend=spec, temperature=0)
    assert expected.error() is None and state.error() is None
    assert values(state, SIX[:4]) == values(expected, SIX[:4])
    assert state.messages() == expected.messages()
    assert plain.token_usage.num_calls == 4
    assert spec.token_usage.num_calls == 1
    assert spec.token_usage.prompt_tokens < plain.token_usage.prompt_tokens


def test_chat_turn_falls_back_on_a_forced_mismatch(v1):
    # The model writes "Job:" after the age; the program says otherwise.
    labels = ["Name", "Age", "Favourite colour", "Hobby"]
    expected = chat_profile_program(None, labels).run(
        who="baker", backend=chat_backend(v1), temperature=0
    )
    one_try = chat_backend(v1, max_spec_tries=1)
    state = chat_profile_program(40, labels).run(who="baker", backend=one_try, temperature=0)
    assert state.error() is None
    assert values(state, SIX[:4]) == values(expected, SIX[:4])
    assert state.messages() == expected.messages()
    assert state.get_meta_info("age")["speculative"] is True
    assert "speculative" not in state.get_meta_info("job")
    assert one_try.token_usage.num_calls == 1 + 2  # the speculation, then job and hobby


def metric_values(url: str) -> dict[str, float]:
    text = requests.get(url + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("prompt_tokens_total", "generation_tokens_total"):
            if line.startswith(f"sglite:{name}"):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        if line.startswith("sglite:http_requests_total") and 'route="/v1/' in line:
            if 'status="200"' in line:
                out["calls"] = out.get("calls", 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_token_usage_equals_the_servers_counters(sglite_server, v1):
    backend = completion_backend(v1)
    before = metric_values(sglite_server.url)
    state = profile_program(32).run(first="Dan", backend=backend, temperature=0)
    state.sync()

    @sgl.function
    def pick(s):
        s += "Q: Is the sky blue on a clear day?\nA:"
        s += sgl.select("answer", choices=[" yes", " no"])

    assert pick.run(backend=backend).error() is None
    time.sleep(0.5)  # the counters are updated when a request finishes
    after = metric_values(sglite_server.url)
    usage = backend.token_usage
    assert usage.num_calls == after["calls"] - before["calls"]
    assert usage.prompt_tokens == after["prompt_tokens_total"] - before["prompt_tokens_total"]
    assert usage.completion_tokens == (
        after["generation_tokens_total"] - before["generation_tokens_total"]
    )


@pytest.mark.parametrize(
    "prefix, choices",
    [
        ("Q: Is the sky blue on a clear day?\nA:", [" yes", " no", " only at night"]),
        ("The capital of France is ", ["Paris", "London", "a small village"]),
    ],
)
def test_select_by_echoed_logprobs_matches_the_native_backend(sglite_server, v1, prefix, choices):
    native = sgl.RuntimeEndpoint(sglite_server.url)
    api = completion_backend(v1)
    for method in (
        sgl.token_length_normalized,
        sgl.greedy_token_selection,
        sgl.unconditional_likelihood_normalized,
    ):

        @sgl.function
        def pick(s, method):
            s += prefix
            s += sgl.select("choice", choices=choices, choices_method=method)

        a, b = pick.run(method, backend=api), pick.run(method, backend=native)
        assert a["choice"] == b["choice"], method
        got = a.get_meta_info("choice")["normalized_prompt_logprobs"]
        want = b.get_meta_info("choice")["normalized_prompt_logprobs"]
        assert got == pytest.approx(want, abs=1e-4)


def test_chat_model_gen_streaming_constraints_and_usage(v1):
    backend = chat_backend(v1)

    @sgl.function
    def qa(s):
        s += sgl.user("Name a color.")
        s += sgl.assistant(sgl.gen("answer", max_tokens=6))

    streamed = qa.run(backend=backend, temperature=0, stream=True)
    chunks = list(streamed.text_iter("answer"))
    whole = qa.run(backend=backend, temperature=0)
    assert "".join(chunks) == streamed["answer"] == whole["answer"] != ""
    assert backend.token_usage.num_calls == 2
    assert whole.get_meta_info("answer")["completion_tokens"] >= 1

    schema = {
        "type": "object",
        "properties": {"color": {"type": "string", "maxLength": 12}},
        "required": ["color"],
    }

    @sgl.function
    def structured(s):
        s += sgl.user("Name a color as JSON.")
        s += sgl.assistant(sgl.gen("json", max_tokens=24, json_schema=schema))

    state = structured.run(backend=backend, temperature=0)
    assert state.error() is None
    assert isinstance(json.loads(state["json"])["color"], str)

    @sgl.function
    def outside(s):
        s += "Hello" + sgl.gen("x", max_tokens=2)

    assert "assistant turn" in str(outside.run(backend=backend).error())


def test_completion_model_regex_gen_int_n_and_logprobs(v1):
    backend = completion_backend(v1)

    @sgl.function
    def prog(s):
        s += "Is the sky blue? Answer:"
        s += sgl.gen("yn", max_tokens=4, regex=r" (yes|no)")
        s += "\nHow many legs does a cat have? Answer with a number:"
        s += sgl.gen_int("legs", max_tokens=4)
        s += "\nCount: 1, 2,"
        s += sgl.gen("lp", max_tokens=2, return_logprob=True, top_logprobs_num=2)
        s += sgl.gen("many", max_tokens=2, n=2)

    state = prog.run(backend=backend, temperature=0)
    assert state.error() is None
    assert state["yn"] in (" yes", " no")
    assert re.fullmatch(r"[-+]?[0-9]+", state["legs"]), state["legs"]
    meta = state.get_meta_info("lp")
    assert len(meta["output_token_logprobs"]) == 2
    assert len(state["many"]) == 2 and state["many"][0] == state["many"][1]
