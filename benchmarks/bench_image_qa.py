"""Image QA with and without caching, as the paper's LLaVA workload: several questions about
each image, asked one after another, on a tiny random LLaVA-1.5 built here with random weights
(`sglite.testing.tiny_models`), so no vision-language weights are downloaded.

Three engines on the same model, alternated round by round, each starting every round from a
flushed cache: sglite as it runs (the radix cache reuses an image's prompt KV, and the vision
tower's features are kept per image), radix cache off (features still kept), and both off
(every question encodes its image and computes its whole prompt). The table gives, per
configuration, the time for the whole workload and per question (median over rounds), the
speedup over no caching, the images the vision tower encoded and its time.

Run: python -m benchmarks.bench_image_qa [--rounds 3] [--images 4] [--questions 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import sglite
from benchmarks.common import markdown_table
from sglite.testing.tiny_models import TinyLlavaShape, build_tiny_llava, data_url, random_png

QUESTIONS = [
    "<image> what is in the picture",
    "<image> what is the color of the main object",
    "<image> how many cat are there",
    "<image> describe the left and the right",
    "<image> where is the tree",
    "<image> what shape is on the top",
]
# A bigger tiny model than the tests': a 224-pixel image in 14-pixel patches is 256 positions.
SHAPE = TinyLlavaShape(
    image_size=224, patch_size=14, vision_hidden=256, vision_layers=6, text_hidden=256,
    text_layers=4, weight_scale=1.0,
)  # fmt: skip
CONFIGS = {
    "sglite (radix + vision cache)": {},
    "radix cache off": {"disable_radix_cache": True},
    "no caching": {"disable_radix_cache": True, "vision_cache_images": 0},
}


def run_workload(engine: sglite.Engine, images: list[str], questions: int) -> tuple[float, dict]:
    """Seconds for every question about every image, one request at a time, and the engine's
    vision counters over the run."""
    engine.flush_cache()
    before = engine.get_server_info()
    start = time.perf_counter()
    for image in images:
        for question in QUESTIONS[:questions]:
            engine.generate(question, {"temperature": 0, "max_new_tokens": 8}, image_data=image)
    elapsed = time.perf_counter() - start
    after = engine.get_server_info()
    keys = ("vision_encoded_images", "vision_encode_seconds", "cached_prompt_tokens")
    return elapsed, {k: after[k] - before[k] for k in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--questions", type=int, default=5)
    args = parser.parse_args()
    path = build_tiny_llava(tempfile.mkdtemp(prefix="tiny-llava-"), SHAPE)
    images = [data_url(random_png(seed, (256, 320))) for seed in range(args.images)]
    engines = {
        name: sglite.Engine(model_path=path, dtype="float32", log_level="error", **kwargs)
        for name, kwargs in CONFIGS.items()
    }
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    counters: dict[str, dict] = {}
    try:
        for engine in engines.values():  # warm-up: kernels, allocator
            run_workload(engine, images[:1], 1)
        for _ in range(args.rounds):
            for name, engine in engines.items():
                elapsed, counters[name] = run_workload(engine, images, args.questions)
                times[name].append(elapsed)
    finally:
        for engine in engines.values():
            engine.shutdown()
    asked = args.images * args.questions
    print(
        f"tiny LLaVA-1.5: {SHAPE.image_tokens} image positions, vision {SHAPE.vision_layers}x"
        f"{SHAPE.vision_hidden}, text {SHAPE.text_layers}x{SHAPE.text_hidden}; {args.images} "
        f"images x {args.questions} questions, 8 output tokens; torch threads "
        f"{torch.get_num_threads()}; median of {args.rounds} rounds"
    )
    base = statistics.median(times["no caching"])
    heads = ["configuration", "workload (s)", "per question (ms)", "speedup", "images encoded",
             "vision tower (s)", "cached prompt tokens"]  # fmt: skip
    rows = []
    for name in CONFIGS:
        total = statistics.median(times[name])
        c = counters[name]
        rows.append(
            [name, f"{total:.2f}", f"{1000 * total / asked:.0f}", f"{base / total:.2f}x",
             str(c["vision_encoded_images"]), f"{c['vision_encode_seconds']:.2f}",
             str(c["cached_prompt_tokens"])]
        )  # fmt: skip
    print("\n" + markdown_table(heads, rows, right=range(1, len(heads)), pad=False))


if __name__ == "__main__":
    main()
