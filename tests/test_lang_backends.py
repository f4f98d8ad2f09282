"""The language on the real model, through both native backends: the in-process Engine backend
and `RuntimeEndpoint` against a real `python -m sglite.launch_server`.

Every test runs on both (`backend` fixture); expected values come straight from the Engine
(`engine` fixture, float32) so the frontend is checked against the runtime, not against itself.
Generations are greedy and a few tokens long to keep the module fast on 2 cores.
"""

from __future__ import annotations

import re
import time
import warnings

import pytest

import sglite as sgl
from sglite.lang.backend.engine_backend import EngineBackend

FEW_SHOT = (
    "Answer with one word.\n"
    "Q: What is the capital of France?\nA: Paris\n"
    "Q: What is the capital of Italy?\nA: Rome\n"
    "Q: What is the capital of Spain?\nA: Madrid\n"
)


def greedy(engine, prompt: str, max_new_tokens: int, **params) -> dict:
    return engine.generate(prompt, {"temperature": 0, "max_new_tokens": max_new_tokens, **params})


# ---------------------------------------------------------------------------- gen
def test_gen_value_text_and_meta_info(backend, engine):
    @sgl.function
    def qa(s, question):
        s += FEW_SHOT + "Q: " + question + "\nA:"
        s += sgl.gen("answer", max_tokens=4, stop="\n")

    state = qa.run(question="What is the capital of Germany?", backend=backend, temperature=0)
    prompt = FEW_SHOT + "Q: What is the capital of Germany?\nA:"
    expected = greedy(engine, prompt, 4, stop="\n")
    assert state.error() is None
    assert state["answer"] == expected["text"]
    assert state.text() == prompt + expected["text"]
    meta = state.get_meta_info("answer")
    assert meta["prompt_tokens"] == expected["meta_info"]["prompt_tokens"]
    assert meta["completion_tokens"] == len(expected["output_ids"])
    assert meta["finish_reason"]["type"] in ("stop", "length")


def test_gen_logprobs_n_and_gen_int(backend):
    @sgl.function
    def prog(s):
        s += "Count: 1, 2, 3,"
        s += sgl.gen("lp", max_tokens=2, return_logprob=True, top_logprobs_num=2)
        s += " and then"
        s += sgl.gen("many", max_tokens=2, n=2)
        s += "\nHow many legs does a cat have? Answer with a number:"
        s += sgl.gen_int("legs", max_tokens=3)

    with warnings.catch_warnings():
        # The runtime enforces dtype's regex: no "runs unconstrained" fallback warning.
        warnings.filterwarnings("error", message=".*constrained decoding")
        state = prog.run(backend=backend, temperature=0)
        state.sync()
    assert state.error() is None
    meta = state.get_meta_info("lp")
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == 2
    assert len(meta["output_top_logprobs"][0]) == 2
    assert isinstance(state["many"], list) and len(state["many"]) == 2
    assert state["many"][0] == state["many"][1]  # greedy twice
    assert re.fullmatch(r"[-+]?[0-9]+", state["legs"]), state["legs"]


# ---------------------------------------------------------------------------- roles
def test_roles_use_the_models_chat_template(backend, engine):
    @sgl.function
    def chat(s, question):
        s += sgl.system("You are terse.")
        with s.user():
            s += question
        s += sgl.assistant(sgl.gen("answer", max_tokens=6))

    state = chat.run(question="Name a color.", backend=backend, temperature=0)
    history = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a color."},
    ]
    prompt = engine.tokenizer.apply_chat_template(history, add_generation_prompt=True)
    expected = greedy(engine, prompt, 6, stop=["<|im_end|>"])
    assert state["answer"] == expected["text"]
    assert state.text() == prompt + expected["text"] + "<|im_end|>\n"
    assert state.messages() == [*history, {"role": "assistant", "content": expected["text"]}]


def test_default_system_prompt_and_nested_roles(backend, engine):
    @sgl.function
    def chat(s):
        s += sgl.user("Hi")
        s += sgl.assistant_begin()
        s += sgl.user("nested")

    with pytest.raises(ValueError, match="Nested roles are not allowed"):
        chat.run(backend=backend)

    @sgl.function
    def opening(s):
        s += sgl.user("Hi") + sgl.assistant_begin()

    state = opening.run(backend=backend)
    expected = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True
    )
    assert state.text() == expected  # the template's default system turn is inserted
    assert state.messages()[0]["role"] == "system"


# ---------------------------------------------------------------------------- select
def direct_choice_scores(engine, prefix: str, choices: list[str]) -> dict[str, list]:
    """Each choice's token logprobs, straight from the Engine: the tokens of prefix + choice
    after the part shared with the prefix's own tokenization, conditional and unconditional."""
    tok = engine.tokenizer
    prefix_ids = tok.encode(prefix)
    cond, uncond = [], []
    for choice in choices:
        full = tok.encode(prefix + choice)
        common = 0
        while common < min(len(prefix_ids), len(full)) and prefix_ids[common] == full[common]:
            common += 1
        assert common >= len(prefix_ids) - 1, "test precondition: at most one token re-merged"
        params = {"max_new_tokens": 0}
        r = engine.generate(input_ids=full, sampling_params=params, return_logprob=True,
                            logprob_start_len=0)  # fmt: skip
        cond.append([e[0] for e in r["meta_info"]["input_token_logprobs"][common:]])
        u = engine.generate(input_ids=full[common:], sampling_params=params,
                            return_logprob=True, logprob_start_len=0)  # fmt: skip
        entries = u["meta_info"]["input_token_logprobs"]
        uncond.append([0.0 if e[0] is None else e[0] for e in entries])
    return {"cond": cond, "uncond": uncond}


def expected_decisions(scores: dict[str, list], choices: list[str]) -> dict[str, str]:
    cond, uncond = scores["cond"], scores["uncond"]
    mean = [sum(c) / len(c) for c in cond]
    rel = [sum(a - b for a, b in zip(c, u)) / len(c) for c, u in zip(cond, uncond)]
    width = max(len(c) for c in cond)
    rows = [c + [sum(c) / len(c)] * (width - len(c)) for c in cond]
    alive = list(range(len(choices)))
    for j in range(width):
        best = max(rows[i][j] for i in alive)
        alive = [i for i in alive if rows[i][j] == best]
        if len(alive) == 1:
            break
    return {
        "token_length_normalized": choices[mean.index(max(mean))],
        "greedy_token_selection": choices[alive[0]],
        "unconditional_likelihood_normalized": choices[rel.index(max(rel))],
        "means": mean,
    }


@pytest.mark.parametrize(
    "prefix, choices",
    [
        # Choices with a leading space: the prefix's tokens are unchanged.
        ("Q: Is the sky blue on a clear day?\nA:", [" yes", " no", " only at night"]),
        # A trailing space merges into each choice's first token ("token healing").
        ("The capital of France is ", ["Paris", "London", "a small village"]),
    ],
)
def test_select_follows_the_models_logprobs(backend, engine, prefix, choices):
    methods = {
        "token_length_normalized": sgl.token_length_normalized,
        "greedy_token_selection": sgl.greedy_token_selection,
        "unconditional_likelihood_normalized": sgl.unconditional_likelihood_normalized,
    }

    @sgl.function
    def pick(s, method_name):
        s += prefix
        s += sgl.select("choice", choices=choices, choices_method=methods[method_name])

    expected = expected_decisions(direct_choice_scores(engine, prefix, choices), choices)
    for name in methods:
        state = pick.run(method_name=name, backend=backend)
        assert state.error() is None
        assert state["choice"] == expected[name], name
        assert state.text() == prefix + expected[name]
        scores = state.get_meta_info("choice")["normalized_prompt_logprobs"]
        assert scores == pytest.approx(expected["means"], abs=2e-3)


# ---------------------------------------------------------------------------- fork / join
def test_fork_join_and_cache_hits(backend, engine):
    @sgl.function
    def branches(s):
        s += FEW_SHOT + "Q: What is the capital of Japan?\nA:"
        forks = s.fork(2)
        forks[0] += sgl.gen("ans", max_tokens=2, stop="\n")
        forks[1] += " I think" + sgl.gen("ans", max_tokens=2, stop="\n")
        forks.join()
        s += "|"
        again = s.fork(2)
        again += lambda i: f" ({i})"
        again.join("concate_and_append")

    state = branches.run(backend=backend, temperature=0)
    assert state.error() is None
    prefix = FEW_SHOT + "Q: What is the capital of Japan?\nA:"
    prefix_tokens = len(engine.tokenizer.encode(prefix))
    assert state["ans"][0] == greedy(engine, prefix, 2, stop="\n")["text"]
    assert len(state["ans"]) == 2
    for meta in state.get_meta_info("ans"):
        # The fork point was prefilled first, so both branches found it in the cache.
        assert meta["cached_tokens"] >= prefix_tokens - 1
    assert state.text() == prefix + "| (0) (1)"


def test_copy_var_scope_and_contains(backend):
    @sgl.function
    def prog(s):
        s += "Colors: red, green,"
        with s.var_scope("more"):
            s += sgl.gen("next", max_tokens=2)
        with s.copy() as c:
            c += " and" + sgl.gen("alt", max_tokens=2)

    state = prog.run(backend=backend, temperature=0)
    assert state["more"] == state["next"]
    assert state.text() == "Colors: red, green," + state["next"]
    assert "alt" in state and isinstance(state["alt"], list)
    assert "missing" not in state


# ---------------------------------------------------------------------------- streaming
def test_streaming_yields_the_same_text(backend):
    @sgl.function
    def prog(s):
        s += sgl.user("Count from one to five.")
        s += sgl.assistant(sgl.gen("answer", max_tokens=8))

    normal = prog.run(backend=backend, temperature=0)
    streamed = prog.run(backend=backend, temperature=0, stream=True)
    chunks = list(streamed.text_iter("answer"))
    assert "".join(chunks) == normal["answer"]
    assert len(chunks) > 1
    assert streamed.text() == normal.text()
    meta, reference = streamed.get_meta_info("answer"), normal.get_meta_info("answer")
    assert meta["completion_tokens"] == reference["completion_tokens"]
    assert meta["finish_reason"] == reference["finish_reason"]


# ---------------------------------------------------------------------------- run_batch
def test_run_batch_order_error_isolation_and_precache(backend, engine):
    @sgl.function
    def qa(s, question, max_tokens=3):
        s += FEW_SHOT
        s += "Q: " + question + "\nA:"
        s += sgl.gen("answer", max_tokens=max_tokens, stop="\n")

    questions = ["What is the capital of Germany?", "bad", "What is the capital of Egypt?"]
    batch = [{"question": q, "max_tokens": -1 if q == "bad" else 3} for q in questions]
    sgl.flush_cache(backend)
    # One thread: without pre-caching the first program could not hit the cache.
    states = qa.run_batch(batch, backend=backend, temperature=0, num_threads=1)
    assert states[1].error() is not None and "max_new_tokens" in str(states[1].error())
    few_shot_tokens = len(engine.tokenizer.encode(FEW_SHOT))
    for i in (0, 2):
        assert states[i].error() is None
        prompt = FEW_SHOT + "Q: " + questions[i] + "\nA:"
        assert states[i].text().startswith(prompt)
        assert states[i]["answer"] == greedy(engine, prompt, 3, stop="\n")["text"]
        assert states[i].get_meta_info("answer")["cached_tokens"] >= few_shot_tokens
    parallel = qa.run_batch(
        [{"question": q} for q in questions[::2]], backend=backend, temperature=0
    )
    assert [s["answer"] for s in parallel] == [states[0]["answer"], states[2]["answer"]]


def test_flush_cache_and_server_info(backend):
    assert "cache_hit_rate" in sgl.get_server_info(backend)
    sgl.flush_cache(backend)


def test_engine_as_default_backend(engine):
    old = sgl.global_config.default_backend
    try:
        sgl.set_default_backend(engine)
        assert isinstance(sgl.global_config.default_backend, EngineBackend)

        @sgl.function
        def prog(s):
            s += "1, 2, 3,"
            s += sgl.gen("x", max_tokens=2)

        assert prog(temperature=0)["x"] == greedy(engine, "1, 2, 3,", 2)["text"]
    finally:
        sgl.global_config.default_backend = old


@pytest.mark.slow
def test_runtime_starts_a_server_and_shuts_it_down():
    start = time.perf_counter()
    runtime = sgl.Runtime(dtype="float32", max_total_tokens=2048, port=31000)
    try:
        assert time.perf_counter() - start < 300

        @sgl.function
        def prog(s):
            s += "1, 2, 3,"
            s += sgl.gen("x", max_tokens=2)

        state = prog.run(backend=runtime, temperature=0)
        assert state.error() is None and state["x"]
        assert runtime.endpoint.get_model_name().endswith(".gguf")
        pid = runtime.pid
    finally:
        runtime.shutdown()
    assert runtime.pid is None
    with pytest.raises(OSError):
        import os

        os.kill(pid, 0)
