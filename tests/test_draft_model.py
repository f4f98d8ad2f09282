"""Draft-model speculative decoding (`--speculative-algorithm draft`): a second model with the
target's tokenizer proposes each draft, and keeps its own KV pool and radix cache that follow
the target's accepted tokens. Outputs are those of decoding without it."""

from __future__ import annotations

import json

import pytest
from test_loader import PROMPT, make_hf_model
from test_speculative import CHAT, COPY_PROMPTS, FREE_PROMPTS, GREEDY

from sglite.runtime.server_args import ServerArgs


def _draft_info(engine) -> dict:
    return engine.get_server_info()["speculative_draft"]


def test_greedy_outputs_are_identical_and_the_agreeing_draft_is_accepted(engine, engine_draft):
    """The draft model is the target itself, so a broken draft KV (not following the accepted
    tokens, or a stale cached prefix) would show as rejected drafts."""
    engine_draft.flush_cache()
    assert _draft_info(engine_draft)["cached_tokens"] == 0
    for prompt in [COPY_PROMPTS[0], FREE_PROMPTS[0], FREE_PROMPTS[0]]:  # the last one cached
        want = engine.generate(prompt, GREEDY)
        got = engine_draft.generate(prompt, GREEDY)
        assert got["output_ids"] == want["output_ids"], prompt
        meta = got["meta_info"]
        assert meta["spec_accepted_tokens"] >= 0.9 * meta["spec_draft_tokens"] > 0, meta
        # Each verification emits its accepted tokens plus one of the target's own.
        assert meta["spec_verify_ct"] <= meta["completion_tokens"] // 4, meta
    # Finished requests' prompts and outputs stay in the draft model's own cache.
    assert _draft_info(engine_draft)["cached_tokens"] >= 2 * GREEDY["max_new_tokens"]
    batch = [COPY_PROMPTS[1], FREE_PROMPTS[1], COPY_PROMPTS[2], FREE_PROMPTS[0]]
    params = [{**GREEDY, "max_new_tokens": n} for n in (32, 16, 24, 8)]
    want = engine.generate(batch, params)
    got = engine_draft.generate(batch, params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    engine_draft.flush_cache()
    assert _draft_info(engine_draft)["cached_tokens"] == 0


def test_stops_logprobs_grammars_and_seeded_sampling_behave_as_without(engine, engine_draft):
    prompt = COPY_PROMPTS[0]
    stop = {**GREEDY, "stop": [" keeper"]}
    want, got = engine.generate(prompt, stop), engine_draft.generate(prompt, stop)
    assert got["text"] == want["text"] and "keeper" not in got["text"]
    lp = {**GREEDY, "max_new_tokens": 16}
    want = engine.generate(prompt, lp, return_logprob=True)
    got = engine_draft.generate(prompt, lp, return_logprob=True)
    ours, theirs = (o["meta_info"]["output_token_logprobs"] for o in (got, want))
    assert [t for _, t, _ in ours] == [t for _, t, _ in theirs]
    assert max(abs(a - b) for (a, _, _), (b, _, _) in zip(ours, theirs, strict=True)) < 1e-3
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    record = CHAT.format("Fill a JSON record: Name: Ada Lovelace. Age: 36.")
    params = {**GREEDY, "max_new_tokens": 40, "json_schema": json.dumps(schema)}
    want, got = engine.generate(record, params), engine_draft.generate(record, params)
    assert got["output_ids"] == want["output_ids"]
    assert set(json.loads(got["text"])) == {"name", "age"}
    seeded = [{"temperature": 1.0, "max_new_tokens": 24, "seed": s} for s in range(4)]
    want = engine.generate([FREE_PROMPTS[0]] * 4, seeded)
    got = engine_draft.generate([FREE_PROMPTS[0]] * 4, seeded)
    assert len({o["text"] for o in want}) >= 2  # the samples really vary
    same = sum(a["output_ids"] == b["output_ids"] for a, b in zip(got, want, strict=True))
    assert same >= 3, same  # one near-tie flipped by the passes' rounding at most
    assert sum(o["meta_info"]["spec_accepted_tokens"] for o in got) > 0


def test_server_info_describes_the_draft_model(engine_draft):
    info = engine_draft.get_server_info()
    assert info["speculative_algorithm"] == "draft"
    draft = info["speculative_draft"]
    assert draft["model_path"] == info["model_path"]
    assert draft["num_layers"] == 30 and draft["quantization"] == "int4"
    assert draft["pool_tokens"] > 0 and draft["forward_passes"] > 0


def test_a_smaller_draft_model_and_an_early_exit_draft_leave_outputs_unchanged(tmp_path):
    """Tiny random models with one tokenizer: a 4-layer target; as drafts, a different 1-layer
    model and the target's own first layer. Outputs equal the target's alone."""
    import sglite

    target, small = str(tmp_path / "target"), str(tmp_path / "small")
    make_hf_model("llama", target, num_hidden_layers=4)
    make_hf_model("llama", small, num_hidden_layers=1, hidden_size=32, intermediate_size=48)
    params = [{"temperature": 0, "max_new_tokens": n} for n in (24, 17, 9)]
    prompts = [PROMPT, PROMPT[:6], PROMPT[2:]]
    common = {"model_path": target, "dtype": "float32", "log_level": "error"}
    eng = sglite.Engine(**common)
    want = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
    eng.shutdown()
    drafts = [
        {"speculative_draft_model_path": small},
        {"speculative_draft_model_path": target, "speculative_draft_num_layers": 1},
    ]
    for draft in drafts:
        eng = sglite.Engine(**common, speculative_algorithm="draft", **draft)
        try:
            outs = eng.generate(input_ids=prompts, sampling_params=params)
            assert [o["output_ids"] for o in outs] == want, draft
            assert sum(o["meta_info"]["spec_draft_tokens"] for o in outs) > 0
            info = eng.get_server_info()
            assert info["speculative_draft"]["num_layers"] == 1
            assert "3" in info["speculative_costs"]  # per batch size measured (3, then fewer)
            eng.check_invariants()
        finally:
            eng.shutdown()


def test_bad_draft_model_arguments_are_refused(tmp_path):
    from sglite.runtime.model.loader import default_model_path, load_model
    from sglite.runtime.scheduler.draft_model import DraftModelProposer

    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        ServerArgs(speculative_algorithm="draft").validate()
    with pytest.raises(ValueError, match="speculative_algorithm='draft' only"):
        ServerArgs(speculative_draft_model_path="x").validate()
    with pytest.raises(ValueError, match="speculative_draft_num_layers"):
        ServerArgs(
            speculative_algorithm="standalone",  # SGLang's name
            speculative_draft_model_path="x",
            speculative_draft_num_layers=0,
        ).validate()
    target_path = str(tmp_path / "target")
    make_hf_model("llama", target_path)
    target = load_model(target_path, dtype="float32", progress=False)
    args = ServerArgs(
        model_path=target_path,
        speculative_algorithm="draft",
        speculative_draft_model_path=default_model_path(),
    )
    with pytest.raises(ValueError, match="vocabulary differs"):
        DraftModelProposer.load(args, target, context_len=128, capacity=256)
