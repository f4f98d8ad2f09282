"""Images in: tiny random LLaVA-1.5, LLaVA-NeXT and Idefics3 (SmolVLM) models built with
transformers in a temp dir with their processors, served by sglite and compared with
transformers on the same image and text; the radix cache reuses a prompt's image by content
and never across different images; bad images are refused with a message."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

import sglite
from sglite.testing.tiny_models import (
    TinyLlavaShape,
    build_tiny_idefics3,
    build_tiny_llava,
    build_tiny_llava_next,
    data_url,
    random_png,
)

IMAGE_TOKENS = TinyLlavaShape().image_tokens
GREEDY = {"temperature": 0, "max_new_tokens": 8}
_png = random_png
_REFERENCES: dict[str, tuple] = {}  # model dir -> transformers' model and processor


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory) -> str:
    return build_tiny_llava(str(tmp_path_factory.mktemp("llava")))


@pytest.fixture(scope="module")
def engine(llava_dir):
    """Chunked prefill of 8 tokens: every image is computed across several chunks."""
    eng = sglite.Engine(
        model_path=llava_dir, dtype="float32", chunked_prefill_size=8, log_level="error"
    )
    yield eng
    eng.shutdown()


def _hf_greedy(model_dir: str, prompt: str, png: bytes, steps: int) -> tuple[list[int], dict]:
    """transformers' greedy tokens, the log-probabilities of each step and its inputs."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    if model_dir not in _REFERENCES:
        _REFERENCES[model_dir] = (
            AutoModelForImageTextToText.from_pretrained(model_dir).eval(),
            AutoProcessor.from_pretrained(model_dir),
        )
    model, processor = _REFERENCES[model_dir]
    image = Image.open(io.BytesIO(png)).convert("RGB")
    inputs = processor(text=prompt, images=[image], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=steps, do_sample=False, output_scores=True,
            return_dict_in_generate=True, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    new = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    return new, {
        "logprobs": torch.stack([s[0].log_softmax(-1) for s in out.scores]),
        "prompt_tokens": inputs["input_ids"].shape[1],
    }


def _check_against_transformers(engine, model_dir: str, cases: list[tuple[str, bytes]]) -> None:
    for prompt, png in cases:
        want, ref = _hf_greedy(model_dir, prompt, png, GREEDY["max_new_tokens"])
        got = engine.generate(
            prompt, {**GREEDY, "ignore_eos": True}, image_data=data_url(png), return_logprob=True
        )
        assert got["output_ids"] == want, prompt
        ours = [lp for lp, _, _ in got["meta_info"]["output_token_logprobs"]]
        theirs = [float(ref["logprobs"][i, t]) for i, t in enumerate(want)]
        assert np.allclose(ours, theirs, atol=1e-3), (ours, theirs)
        assert got["meta_info"]["prompt_tokens"] == ref["prompt_tokens"]


def test_llava_greedy_tokens_and_logprobs_match_transformers(engine, llava_dir):
    cases = [("<image> describe the picture", _png(1)), ("what is in <image> the sky", _png(2))]
    _check_against_transformers(engine, llava_dir, cases)
    # Input logprobs across the image: its positions are no tokens (None), the rest are scored.
    got = engine.generate(
        "what is in <image> the sky", {**GREEDY, "max_new_tokens": 1}, image_data=data_url(_png(2)),
        return_logprob=True, logprob_start_len=0,
    )  # fmt: skip
    entries = got["meta_info"]["input_token_logprobs"]
    assert len(entries) == 3 + IMAGE_TOKENS + 2
    assert [e[0] is None for e in entries[3 : 3 + IMAGE_TOKENS]] == [True] * IMAGE_TOKENS
    assert all(e[0] is not None for e in entries[1:3] + entries[3 + IMAGE_TOKENS :])


@pytest.mark.parametrize("build", [build_tiny_llava_next, build_tiny_idefics3])
def test_llava_next_and_idefics3_match_transformers(build, tmp_path):
    """Any-resolution tiles (LLaVA-NeXT) and split images between row/column markers (Idefics3,
    SmolVLM's architecture): spans whose length depends on the picture's size."""
    model_dir = build(str(tmp_path / "model"))
    wide, tall = _png(1, (40, 70)), _png(2, (70, 36))
    with sglite.Engine(model_path=model_dir, dtype="float32", log_level="error") as eng:
        _check_against_transformers(
            eng, model_dir, [("what is in <image> the sky", wide), ("<image> describe it", tall)]
        )


def test_the_same_image_reuses_the_cache_and_a_different_one_does_not(engine):
    engine.flush_cache()
    before = engine.get_server_info()
    cat, dog = data_url(_png(7)), data_url(_png(8))
    first = engine.generate("<image> what is in the picture", GREEDY, image_data=cat)
    again = engine.generate("<image> describe it", GREEDY, image_data=cat)
    other = engine.generate("<image> describe it", GREEDY, image_data=dog)
    assert first["meta_info"]["cached_tokens"] == 0
    # The second question about the same picture finds the image's positions cached.
    assert again["meta_info"]["cached_tokens"] == IMAGE_TOKENS
    assert other["meta_info"]["cached_tokens"] == 0  # a different picture: nothing shared
    # The same picture as a file path, and re-encoded with the same pixels: still cached.
    info = engine.get_server_info()
    assert info["vision_encoded_images"] - before["vision_encoded_images"] == 2
    same = engine.generate("<image> describe it", GREEDY, image_data=cat)
    assert same["output_ids"] == again["output_ids"]
    assert same["meta_info"]["cached_tokens"] >= IMAGE_TOKENS


def test_bad_images_are_refused_with_a_message(engine, tmp_path):
    from PIL import Image

    huge = tmp_path / "huge.png"
    Image.new("L", (6100, 6100)).save(huge)  # 37 megapixels, a few kB of PNG
    cases = [
        (str(huge), "6100x6100 pixels, more than"),
        ("data:image/png;base64,AAAA", "cannot be decoded"),
        ("data:text/plain,hello", "base64"),
        (str(tmp_path / "missing.png"), "not a data: URL, an existing file"),
        ("https://example.com/cat.png", "--allow-remote-images"),
        ([data_url(_png(1))] * 9, "more than the 8"),
    ]
    for image, message in cases:
        with pytest.raises(ValueError, match="image_data") as err:
            engine.generate("<image> describe it", GREEDY, image_data=image)
        assert message in str(err.value), (message, str(err.value))
    with pytest.raises(ValueError, match="2 image tokens"):
        engine.generate("<image> <image> describe", GREEDY, image_data=data_url(_png(1)))
    # The engine keeps serving.
    assert engine.generate("describe it", GREEDY)["meta_info"]["completion_tokens"] > 0


def test_openai_chat_with_image_url_parts_over_http(llava_dir, engine, sglite_server, tmp_path):
    import openai
    import requests
    from server_fixtures import ServerProcess

    png = _png(5)
    path = tmp_path / "picture.png"
    path.write_bytes(png)
    server = ServerProcess("--model-path", llava_dir, "--allow-remote-images")
    files = _serve_directory(tmp_path)  # a real HTTP server on loopback for the remote image
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)

        def ask(url: str):
            content = [{"type": "image_url", "image_url": {"url": url}},
                       {"type": "text", "text": "describe the picture"}]  # fmt: skip
            return client.chat.completions.create(
                model="llava", messages=[{"role": "user", "content": content}],
                temperature=0, max_tokens=8,
            )  # fmt: skip

        first, again = ask(data_url(png)), ask(str(path))  # a data: URL, then a file path
        fetched = ask(f"http://127.0.0.1:{files.server_port}/picture.png")  # an http(s) URL
        assert first.choices[0].message.content == again.choices[0].message.content
        assert fetched.choices[0].message.content == first.choices[0].message.content
        assert first.usage.prompt_tokens == IMAGE_TOKENS + 3
        assert again.usage.prompt_tokens_details.cached_tokens >= IMAGE_TOKENS
        # What the Engine answers for the same rendered prompt and image.
        want = engine.generate("<image> describe the picture  ", GREEDY, image_data=data_url(png))
        assert first.choices[0].message.content == want["text"]
        other = ask(data_url(_png(6)))
        assert other.usage.prompt_tokens_details.cached_tokens == 0
        with pytest.raises(openai.BadRequestError) as err:
            ask("data:image/png;base64,AAAA")
        assert "messages.0.content.0: the image cannot be decoded" in str(err.value)
        body = {"text": "<image> describe it", "image_data": data_url(png),
                "sampling_params": GREEDY}  # fmt: skip
        native = requests.post(server.url + "/generate", json=body, timeout=60).json()
        assert native["meta_info"]["cached_tokens"] >= IMAGE_TOKENS
        # The cache view shows an image's positions as [image], never as token text.
        tree = requests.get(server.url + "/cache/tree", timeout=30).json()
        assert any(node["text"].startswith("[image]") for node in tree["nodes"]), tree["nodes"]
    finally:
        files.shutdown()
        assert server.stop() == 0
    # A text-only model refuses images on both APIs with a 400 naming the field.
    text_only = openai.OpenAI(base_url=sglite_server.url + "/v1", api_key="none", max_retries=0)
    content = [{"type": "image_url", "image_url": {"url": data_url(png)}}]
    with pytest.raises(openai.BadRequestError, match="only text content parts"):
        text_only.chat.completions.create(
            model="x", messages=[{"role": "user", "content": content}], max_tokens=2
        )
    r = requests.post(sglite_server.url + "/generate", json={"text": "Hi", "image_data": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "image_data", r.text
    assert "takes text only" in r.json()["error"]["message"]


def test_llava_chatml_image_part_over_openai_chat_matches_transformers(tmp_path):
    """LLaVA-1.5 at 56 px in 14-pixel patches (`num_additional_image_tokens=1`, the "default"
    strategy drops CLS: 16 image positions) whose ChatML-style template writes an image part as
    `<image>\\n` (issue 49): the chat route gives the template the image part, as transformers'
    processor does, so the prompt is transformers' to the token and so is the greedy answer."""
    import openai
    from server_fixtures import ServerProcess
    from transformers import AutoTokenizer

    shape = TinyLlavaShape(image_size=56, patch_size=14, vision_layers=2)
    model_dir = build_tiny_llava(str(tmp_path / "model"), shape, chatml=True)
    png = _png(3, (64, 80))  # 80x64
    question = "describe the picture"
    content = [{"type": "image"}, {"type": "text", "text": question}]
    _hf_greedy(model_dir, "<image>", png, 1)  # loads the reference model and processor
    prompt = _REFERENCES[model_dir][1].apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True
    )
    assert "<image>\n" in prompt, prompt
    want, ref = _hf_greedy(model_dir, prompt, png, GREEDY["max_new_tokens"])
    assert ref["prompt_tokens"] == shape.image_tokens + 12, ref["prompt_tokens"]
    server = ServerProcess("--model-path", model_dir)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        parts = [{"type": "image_url", "image_url": {"url": data_url(png)}},
                 {"type": "text", "text": question}]  # fmt: skip
        got = client.chat.completions.create(
            model="llava", messages=[{"role": "user", "content": parts}], temperature=0,
            max_tokens=GREEDY["max_new_tokens"], logprobs=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
    finally:
        assert server.stop() == 0
    assert got.usage.prompt_tokens == ref["prompt_tokens"]
    tokens = got.choices[0].logprobs.content
    assert [t.token for t in tokens] == AutoTokenizer.from_pretrained(
        model_dir
    ).convert_ids_to_tokens(want)
    theirs = [float(ref["logprobs"][i, t]) for i, t in enumerate(want)]
    assert np.allclose([t.logprob for t in tokens], theirs, atol=1e-3), tokens


def test_sgl_image_in_a_program(engine, tmp_path):
    png = _png(4)
    path = tmp_path / "picture.png"
    path.write_bytes(png)

    @sglite.function
    def describe(s, picture):
        s += sglite.image(picture) + " describe the picture"
        s += sglite.gen("answer", max_tokens=8, temperature=0)
        s += " what is in" + sglite.image(png) + " the sky"  # bytes, a second image
        s += sglite.gen("second", max_tokens=4, temperature=0)

    state = describe.run(picture=str(path), backend=sglite.EngineBackend(engine))
    want = engine.generate("<image> describe the picture", GREEDY, image_data=data_url(png))
    assert state["answer"] == want["text"]
    prompt = "<image> describe the picture" + want["text"] + " what is in<image> the sky"
    second = engine.generate(prompt, {**GREEDY, "max_new_tokens": 4}, image_data=[png, png])
    assert state["second"] == second["text"]
    with pytest.raises(ValueError, match="sgl.image: cannot read"):
        sglite.image(tmp_path / "missing.png")


def _serve_directory(path):  # noqa: ANN202
    """A threading HTTP server for the files under `path` on a free loopback port."""
    import functools
    import http.server
    import threading

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _write_video(path, colors: list[int]) -> None:
    """An MPEG-4 video of solid frames, frame i's red channel `colors[i]`."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 48, 32, "yuv420p"
        for red in colors:
            frame = np.zeros((32, 48, 3), dtype=np.uint8)
            frame[..., 0] = red
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


def test_sgl_video_sends_sampled_frames(engine, tmp_path):
    path = tmp_path / "clip.mp4"
    _write_video(path, [20 * i for i in range(12)])
    frames = sglite.video(path, num_frames=4).expr_list
    assert len(frames) == 4
    reds = []
    for frame in frames:  # evenly spaced frames: their red rises through the clip
        from PIL import Image

        pixels = np.asarray(Image.open(io.BytesIO(_decode_data_url(frame.source))))
        reds.append(int(pixels[..., 0].mean()))
    assert reds == sorted(reds) and reds[-1] - reds[0] > 100, reds

    @sglite.function
    def watch(s, clip):
        s += sglite.video(clip, num_frames=4) + " describe it"
        s += sglite.gen("answer", max_tokens=6, temperature=0)

    state = watch.run(clip=str(path), backend=sglite.EngineBackend(engine))
    sources = [frame.source for frame in frames]
    params = {"temperature": 0, "max_new_tokens": 6}
    want = engine.generate("<image><image><image><image> describe it", params, image_data=sources)
    assert state["answer"] == want["text"]
    with pytest.raises(ValueError, match="cannot read"):
        sglite.video(tmp_path / "missing.mp4")


def _decode_data_url(url: str) -> bytes:
    import base64

    return base64.b64decode(url.split(",", 1)[1])
