"""JSON decoding benchmark (the SGLang paper's JSON workload): extract a multi-field JSON object
from each of `--num-docs` documents, constrained by a JSON schema or by the equivalent regex.

Documents are synthetic and deterministic (no download): encyclopedia-style paragraphs about
invented cities (name, country, population, founding year, mayor) and character profiles (name,
age, occupation, hometown, hobby), alternating, each with distractor names and numbers. Every
prompt is a chat turn with one worked example (shared by all documents of a kind, so it is a
cached prefix) followed by the document.

Configurations, each a fresh engine started, measured and shut down in turn (so none competes
with another for the cores), all greedy with the same dtype, threads and `--max-new-tokens`:
- token-by-token: sglite with `disable_jump_forward=True`, the baseline of every ratio;
- exact jump-forward: the default engine (forced tokens drafted and verified in one forward;
  greedy outputs must equal token-by-token's, the `differ` column counts those that do not);
- retokenize jump-forward: SGLang's original (forced text retokenized, appended unverified);
- unconstrained: the same prompts without a constraint (valid = parses and fits the schema);
- llama.cpp: `llama-server` on the same GGUF with grammar-constrained sampling (`json_schema` /
  a GBNF `grammar` equivalent to the regex on `/completion`), `-np` parallel slots driven
  concurrently; run when a binary is found (`--llama-server PATH`, else the best configuration
  for the host that `benchmarks/build_llama_cpp.sh` built, else on PATH; its build is printed
  beside the table). A llama-server that crashes gets a row saying "crashed at start-up (exit
  -11 SIGSEGV, log: PATH)" per variant and a line in the summary. Note
  that llama.cpp computes in the GGUF's quantized format and its JSON schemas allow free
  whitespace, while sglite dequantizes (bf16 or fp32) and uses fixed separators.

Per configuration and variant: wall time of the whole batch (engine start and warm-up
excluded), documents/s, output tokens/s, CPU seconds of the model process (scheduler or
llama-server; less sensitive than wall time to other jobs on a shared machine), forward passes
(server counters), drafted and accepted jump-forward tokens, outputs valid under the constraint
(`jsonschema` or `re.fullmatch`), outputs that parse as JSON, extracted values equal to the
document's, and outputs that differ from token-by-token (by text / by token ids). Ratios are
against token-by-token in the same run; quote those. `--repeats N` keeps the best of N batches.

Run: python -m benchmarks.bench_json [--quick] [--num-docs 64] [--llama-server PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from benchmarks.common import (
    PeerCrashed,
    add_json_option,
    add_llama_server_option,
    command_line,
    cpu_seconds,
    git_revision,
    make_parser,
    markdown_table,
    post_json,
    stop_process,
)
from benchmarks.runners.llama_cpp import (
    find_llama_server,
    llama_build_line,
    llama_failure,
    start_llama_server,
)

COMMAND = "benchmarks.bench_json"
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
VARIANTS = ("schema", "regex")


# ---------------------------------------------------------------------------- constraints
@dataclass(frozen=True)
class Field:
    """One field of the extracted object: a string of at most `size` characters, or a
    non-negative integer of at most `size` digits."""

    key: str
    kind: str  # "str" or "int"
    size: int


@dataclass(frozen=True)
class Kind:
    """A kind of document and the object extracted from it."""

    name: str
    fields: tuple[Field, ...]

    def schema(self) -> dict:
        """The JSON schema: every field required, nothing else allowed."""
        props = {}
        for f in self.fields:
            if f.kind == "str":
                props[f.key] = {"type": "string", "minLength": 1, "maxLength": f.size}
            else:
                props[f.key] = {"type": "integer", "minimum": 0, "maximum": 10**f.size - 1}
        return {
            "type": "object",
            "properties": props,
            "required": [f.key for f in self.fields],
            "additionalProperties": False,
        }

    def regex(self) -> str:
        """The equivalent regex, SGLang style: one field per line, indented by four spaces."""
        lines = []
        for f in self.fields:
            value = rf'"[\w\d\s]{{1,{f.size}}}"' if f.kind == "str" else _int_regex(f.size)
            lines.append(rf'    "{f.key}": {value}')
        return r"\{\n" + r",\n".join(lines) + r"\n\}"

    def gbnf(self) -> str:
        """The regex as a GBNF grammar for llama.cpp (`\\w`, `\\s` as ASCII classes)."""
        parts, rules = [], {}
        for i, f in enumerate(self.fields):
            sep = '"{\\n' if i == 0 else '",\\n'
            parts.append(f'{sep}    \\"{f.key}\\": "')
            name = f"{f.kind}{f.size}"
            parts.append(name)
            if f.kind == "str":
                rules[name] = f'"\\"" [a-zA-Z0-9_ \\t\\n\\r]{{1,{f.size}}} "\\""'
            else:
                rules[name] = f'"0" | [1-9] [0-9]{{0,{f.size - 1}}}'
        parts.append('"\\n}"')
        root = "root ::= " + " ".join(parts)
        return "\n".join([root] + [f"{name} ::= {rule}" for name, rule in rules.items()])

    def check(self, obj: object) -> bool:
        """Whether a parsed object fits the schema (jsonschema when installed)."""
        try:
            import jsonschema
        except ImportError:
            return self._check_by_hand(obj)
        try:
            jsonschema.validate(obj, self.schema())
        except jsonschema.ValidationError:
            return False
        return True

    def _check_by_hand(self, obj: object) -> bool:
        if not isinstance(obj, dict) or set(obj) != {f.key for f in self.fields}:
            return False
        for f in self.fields:
            v = obj[f.key]
            if f.kind == "str" and not (isinstance(v, str) and 1 <= len(v) <= f.size):
                return False
            if f.kind == "int" and not (
                isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 10**f.size
            ):
                return False
        return True


def _int_regex(digits: int) -> str:
    """A JSON non-negative integer of at most `digits` digits (no leading zeros)."""
    return rf"(0|[1-9][0-9]{{0,{digits - 1}}})"


CITY = Kind(
    "city",
    (
        Field("name_of_the_city", "str", 24),
        Field("country_the_city_is_in", "str", 24),
        Field("population_of_the_city", "int", 9),
        Field("year_the_city_was_founded", "int", 4),
        Field("name_of_the_current_mayor", "str", 32),
    ),
)
CHARACTER = Kind(
    "character",
    (
        Field("full_name_of_the_character", "str", 32),
        Field("age_of_the_character_in_years", "int", 3),
        Field("occupation_of_the_character", "str", 24),
        Field("hometown_of_the_character", "str", 24),
        Field("favourite_hobby_of_the_character", "str", 24),
    ),
)


# ---------------------------------------------------------------------------- documents
SYL_A = "Val Kes Bran Mor Tal Esk Dun Ar Sel Qua Vor Lin Cal Ost Hal Mir Thal Gren Pel Rav".split()
SYL_B = "do tre wi ma ro ve li sa ne ka ba thi go de ru la".split()
SYL_C = "ria moor ford ton mark burg heim vale port stead wick grad lund sk".split()
COUNTRIES = (
    "Veloria Castavia Nordmark Eskaland Marovia Tessaria Duvania Orlinth Sarnova Kelvaria "
    "Brisland Amerath"
).split()
FIRST = (
    "Anna Boris Clara Dmitri Elena Felix Greta Hugo Irene Jonas Katya Leon Mara Nils Olga Pavel "
    "Rosa Stefan Tilda Viktor"
).split()
LAST = (
    "Albrecht Brandt Castell Dorn Eklund Falk Gruber Hartmann Ivanov Jansen Keller Lindqvist "
    "Moreau Novak Ortega Petrov Quist Rasmussen Sandoval Thorne"
).split()
RIVERS = "Amber Silver Oster Vell Karn Dune Mirel Tarn".split()
INDUSTRIES = "shipbuilding, textiles, glassmaking, printing, clockmaking, wine, timber".split(", ")
ORIGINS = ["fishing village", "river crossing", "trading post", "monastery", "mining camp"]
ISSUES = ["public transport", "housing", "clean water", "the old harbour", "school buildings"]
OCCUPATIONS = (
    "baker, pilot, teacher, carpenter, astronomer, librarian, nurse, fisherman, architect, "
    "painter, blacksmith, pharmacist"
).split(", ")
HOBBIES = (
    "chess, gardening, rock climbing, painting, sailing, birdwatching, pottery, cycling, "
    "knitting, fencing, beekeeping, archery"
).split(", ")
TRAITS = ["patient", "stubborn", "cheerful", "curious", "quiet", "generous"]


def article(noun: str) -> str:
    """The noun with 'a' or 'an' (by spelling: eight-year-old, eighteen...)."""
    an = noun[0] in "aeiou" or noun.startswith(("8", "11", "18"))
    return ("an " if an else "a ") + noun


def invent_place(rng: random.Random) -> str:
    """An invented place name."""
    return rng.choice(SYL_A) + rng.choice(SYL_B) + rng.choice(SYL_C)


def invent_person(rng: random.Random) -> str:
    """An invented full name."""
    return f"{rng.choice(FIRST)} {rng.choice(LAST)}"


def city_document(rng: random.Random) -> tuple[str, dict]:
    """An encyclopedia-style paragraph about an invented city, and its true facts."""
    name, country, mayor = invent_place(rng), rng.choice(COUNTRIES), invent_person(rng)
    pop, year = rng.randint(5_000, 5_000_000), rng.randint(800, 1950)
    other, other_pop = invent_place(rng), rng.randint(1_000, 90_000)
    first = rng.choice(
        [
            f"{name} is a city in {country}, on the banks of the {rng.choice(RIVERS)} river.",
            f"{name} is the largest city of the {rng.choice(RIVERS)} valley in {country}.",
            f"Located in the north of {country}, {name} is an old city on the coast.",
        ]
    )
    facts = [
        f"It was founded in {year} as a {rng.choice(ORIGINS)} and grew rich from "
        f"{rng.choice(INDUSTRIES)}.",
        f"The latest census counted {pop} inhabitants in the city proper.",
        f"The current mayor is {mayor}, elected after a campaign about {rng.choice(ISSUES)}.",
    ]
    filler = [
        f"The nearby town of {other} has about {other_pop} inhabitants.",
        f"Every summer {name} hosts a festival of {rng.choice(INDUSTRIES)}.",
        f"It is twinned with {invent_place(rng)} in {rng.choice(COUNTRIES)}.",
        f"The former mayor, {invent_person(rng)}, now teaches history at the university.",
    ]
    rng.shuffle(facts)
    body = facts + rng.sample(filler, 2)
    rng.shuffle(body)
    truth = {
        "name_of_the_city": name,
        "country_the_city_is_in": country,
        "population_of_the_city": pop,
        "year_the_city_was_founded": year,
        "name_of_the_current_mayor": mayor,
    }
    return " ".join([first] + body), truth


def character_document(rng: random.Random) -> tuple[str, dict]:
    """A short profile of an invented character, and its true facts."""
    name, age = invent_person(rng), rng.randint(18, 90)
    given = name.split()[0]
    occupation, hometown, hobby = rng.choice(OCCUPATIONS), invent_place(rng), rng.choice(HOBBIES)
    first = rng.choice(
        [
            f"{name} is {article(f'{age}-year-old')} {occupation} from {hometown}.",
            f"{name}, aged {age}, works as {article(occupation)} and was born in {hometown}.",
            f"Born and raised in {hometown}, {name} is {age} years old and {article(occupation)}.",
        ]
    )
    facts = [
        f"In the evenings {given} is passionate about {hobby}.",
        f"Friends describe {given} as {rng.choice(TRAITS)} and reliable.",
    ]
    filler = [
        f"{given}'s cousin {rng.choice(FIRST)} is {article(rng.choice(OCCUPATIONS))} in "
        f"{invent_place(rng)}.",
        f"{given} once spent a year travelling through {rng.choice(COUNTRIES)}.",
        f"At {rng.randint(20, 40)}, {given} briefly tried {rng.choice(HOBBIES)} but gave it up.",
        f"{given}'s neighbour, {invent_person(rng)}, is {rng.randint(18, 90)} years old.",
    ]
    body = facts + rng.sample(filler, 2)
    rng.shuffle(body)
    truth = {
        "full_name_of_the_character": name,
        "age_of_the_character_in_years": age,
        "occupation_of_the_character": occupation,
        "hometown_of_the_character": hometown,
        "favourite_hobby_of_the_character": hobby,
    }
    return " ".join([first] + body), truth


@dataclass
class Doc:
    """One benchmark document with its prompt."""

    kind: Kind
    text: str
    truth: dict
    prompt: str = ""


def make_prompt(kind: Kind, text: str, example: tuple[str, dict]) -> str:
    """A chat turn: the task, one worked example, then the document."""
    keys = ", ".join(f.key for f in kind.fields)
    task = (
        f"Extract the facts about the {kind.name} in the document as a JSON object with the "
        f"keys {keys}.\n\n"
        f"Document: {example[0]}\nJSON: {json.dumps(example[1])}\n\n"
        f"Document: {text}\nJSON:"
    )
    return CHAT.format(task)


def make_docs(n: int, seed: int) -> list[Doc]:
    """n documents, cities and characters alternating, deterministic in `seed`."""
    examples = {
        "city": city_document(random.Random(f"{seed}-example-city")),
        "character": character_document(random.Random(f"{seed}-example-character")),
    }
    docs = []
    for i in range(n):
        rng = random.Random(f"{seed}-{i}")
        kind = CITY if i % 2 == 0 else CHARACTER
        text, truth = (city_document if kind is CITY else character_document)(rng)
        docs.append(Doc(kind, text, truth, make_prompt(kind, text, examples[kind.name])))
    return docs


def constraint_params(doc: Doc, variant: str) -> dict:
    """The sampling-parameter entry for a document's constraint (none for 'free')."""
    if variant == "schema":
        return {"json_schema": json.dumps(doc.kind.schema())}
    if variant == "regex":
        return {"regex": doc.kind.regex()}
    return {}


# ---------------------------------------------------------------------------- results
@dataclass
class Run:
    """One configuration on one variant."""

    config: str
    variant: str
    wall_s: float
    docs: int
    out_tokens: int
    texts: list[str]
    cpu_s: float | None = None  # CPU time of the model process (scheduler / llama-server)
    ids: list[list[int]] | None = None
    forward_passes: int | None = None
    decode_passes: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    valid: int = 0
    json_ok: int = 0
    correct_fields: int = 0
    total_fields: int = 0
    differ_text: int | None = None
    differ_ids: int | None = None
    notes: list[str] = field(default_factory=list)
    status: str = ""  # why there are no figures (a peer's `PeerStatus.cell()`): not measured


def score(run: Run, docs: list[Doc]) -> None:
    """Fill validity, parse and field-accuracy counts from the outputs."""
    for doc, text in zip(docs, run.texts, strict=True):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            obj = None
        run.json_ok += obj is not None
        if run.variant == "regex":
            run.valid += re.fullmatch(doc.kind.regex(), text) is not None
        else:
            run.valid += obj is not None and doc.kind.check(obj)
        run.total_fields += len(doc.truth)
        if isinstance(obj, dict):
            run.correct_fields += sum(obj.get(k) == v for k, v in doc.truth.items())


def compare(run: Run, base: Run, docs: list[Doc]) -> None:
    """Count outputs that differ from the token-by-token run; describe the first one."""
    run.differ_text = sum(a != b for a, b in zip(run.texts, base.texts, strict=True))
    if run.ids is not None and base.ids is not None:
        run.differ_ids = sum(a != b for a, b in zip(run.ids, base.ids, strict=True))
    if run.config != "exact" or not (run.differ_text or run.differ_ids):
        return
    for i, (a, b) in enumerate(zip(run.ids or [], base.ids or [], strict=True)):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            run.notes.append(
                f"exact jump-forward differs from token-by-token on doc {i} ({run.variant}) at "
                f"output token {at}:\n  exact: {run.texts[i]!r}\n  token-by-token: "
                f"{base.texts[i]!r}\n  prompt: {docs[i].prompt!r}\n  constraint: "
                f"{constraint_params(docs[i], run.variant)!r}"
            )
            break


# ---------------------------------------------------------------------------- sglite
SGLITE_CONFIGS = {
    "none": {"disable_jump_forward": True},
    "exact": {"jump_forward_mode": "exact"},
    "retokenize": {"jump_forward_mode": "retokenize"},
    "free": {},
}
LABELS = {
    "none": "sglite token-by-token",
    "exact": "sglite exact jump-forward",
    "retokenize": "sglite retokenize jump-forward",
    "free": "sglite unconstrained",
    "llama": "llama.cpp llama-server",
}
COUNTERS = ("forward_passes", "decode_passes", "jump_forward_drafted_tokens",
            "jump_forward_accepted_tokens")  # fmt: skip


def best_of(tries: list[Run]) -> Run:
    """The fastest of repeated runs, with the least CPU time of any of them."""
    best = min(tries, key=lambda r: r.wall_s)
    cpus = [r.cpu_s for r in tries if r.cpu_s is not None]
    best.cpu_s = min(cpus) if cpus else None
    return best


def _delta(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None else after - before


def bench_sglite(config: str, args: argparse.Namespace, docs: list[Doc]) -> list[Run]:
    """Start an engine for one configuration, run each variant on a cold cache, shut it down."""
    import sglite

    variants = ["free"] if config == "free" else args.variants
    kwargs = dict(SGLITE_CONFIGS[config], dtype=args.dtype, grammar_backend=args.grammar_backend)
    if args.threads:
        kwargs["num_threads"] = args.threads
    runs = []
    with sglite.Engine(log_level="error", **kwargs) as engine:
        args.resolved_dtype = engine.get_server_info().get("dtype")
        warm = CHAT.format("Say hi.")
        engine.generate(warm, {"max_new_tokens": 4, "temperature": 0})
        engine.generate(warm, {"max_new_tokens": 4, "temperature": 0, "regex": "[a-z]{1,8}"})
        for variant in variants:
            params = [
                {
                    "max_new_tokens": args.max_new_tokens,
                    "temperature": 0,
                    **constraint_params(doc, variant),
                }
                for doc in docs
            ]
            tries = []
            for _ in range(args.repeats):
                engine.flush_cache()
                before = engine.get_server_info()
                cpu0 = cpu_seconds(engine.client.process.pid)
                start = time.perf_counter()
                outs = engine.generate([d.prompt for d in docs], params)
                wall = time.perf_counter() - start
                cpu = _delta(cpu_seconds(engine.client.process.pid), cpu0)
                after = engine.get_server_info()
                delta = {k: after[k] - before[k] for k in COUNTERS}
                tries.append(
                    Run(
                        config=config,
                        variant=variant,
                        wall_s=wall,
                        docs=len(docs),
                        out_tokens=sum(o["meta_info"]["completion_tokens"] for o in outs),
                        texts=[o["text"] for o in outs],
                        cpu_s=cpu,
                        ids=[list(o["output_ids"]) for o in outs],
                        forward_passes=delta["forward_passes"],
                        decode_passes=delta["decode_passes"],
                        drafted=delta["jump_forward_drafted_tokens"],
                        accepted=delta["jump_forward_accepted_tokens"],
                    )
                )
            runs.append(best_of(tries))
            print(f"  [{config}/{variant}] {runs[-1].wall_s:.1f} s", flush=True)
    return runs


# ---------------------------------------------------------------------------- llama.cpp
def llama_body(doc: Doc, variant: str, args: argparse.Namespace) -> dict:
    """A greedy /completion request, constrained like sglite's."""
    body = {
        "prompt": doc.prompt,
        "n_predict": args.max_new_tokens,
        "temperature": 0,
        "cache_prompt": True,
        "stream": False,
    }
    if variant == "schema":
        body["json_schema"] = doc.kind.schema()
    else:
        body["grammar"] = doc.kind.gbnf()
    return body


def _llama_once(
    binary: str, args: argparse.Namespace, docs: list[Doc], variant: str, slots: int, log
) -> Run:
    """One timed batch on a freshly started llama-server."""
    from sglite.runtime.model.loader import default_model_path

    threads = args.threads or os.cpu_count() or 1
    ctx = args.llama_ctx_per_slot
    proc, base = start_llama_server(binary, default_model_path(), threads, slots, ctx, log)
    try:
        post_json(base + "/completion", {"prompt": CHAT.format("Say hi."), "n_predict": 4})
        bodies = [llama_body(doc, variant, args) for doc in docs]
        cpu0 = cpu_seconds(proc.pid)
        start = time.perf_counter()
        with ThreadPoolExecutor(slots) as pool:
            url = base + "/completion"
            outs = list(pool.map(post_json, [url] * len(bodies), bodies))
        wall = time.perf_counter() - start
        cpu = _delta(cpu_seconds(proc.pid), cpu0)
    except (OSError, ValueError) as exc:
        status = llama_failure(binary, proc, log.name, exc)
        if status.state == "crashed":
            raise PeerCrashed(status) from exc
        raise
    finally:
        stop_process(proc, timeout=30)
    tokens = [
        o.get("tokens_predicted", (o.get("timings") or {}).get("predicted_n", 0)) for o in outs
    ]
    texts = [o["content"] for o in outs]
    return Run("llama", variant, wall, len(docs), sum(tokens), texts, cpu_s=cpu)


def bench_llama(binary: str, args: argparse.Namespace, docs: list[Doc]) -> list[Run]:
    """Each variant on a freshly started llama-server (an empty prompt cache, as sglite's); a
    variant whose server crashes is a `Run` with that status (its log kept and named)."""
    slots = args.llama_parallel or min(len(docs), 64)
    runs = []
    crashed = False
    with tempfile.NamedTemporaryFile(
        "w", prefix="llama-server-", suffix=".log", delete=False
    ) as log:
        for variant in args.variants:
            try:
                tries = [
                    _llama_once(binary, args, docs, variant, slots, log)
                    for _ in range(args.repeats)
                ]
            except PeerCrashed as exc:
                crashed = True
                runs.append(Run("llama", variant, float("nan"), len(docs), 0, []))
                runs[-1].status = exc.status.cell()
                print(f"  [llama/{variant}] {exc}", flush=True)
                continue
            runs.append(best_of(tries))
            print(f"  [llama/{variant}] {runs[-1].wall_s:.1f} s", flush=True)
    if not crashed:
        os.unlink(log.name)
    return runs


# ---------------------------------------------------------------------------- report
def _fmt(value: object, spec: str = "{}") -> str:
    return "–" if value is None else spec.format(value)


def table(runs: list[Run]) -> str:
    """A Markdown table, with speed-ups against token-by-token on the same variant."""
    if not runs:
        return "(no results)"
    base = {r.variant: r for r in runs if r.config == "none"}
    heads = [
        "configuration", "constraint", "wall s", "docs/s", "out tok/s", "CPU s", "fwd passes",
        "drafted", "accepted", "valid", "JSON ok", "fields right", "differ (text/ids)",
        "docs/s vs tbt", "CPU vs tbt", "passes vs tbt",
    ]  # fmt: skip
    rows = []
    for r in runs:
        if r.status:
            label = [LABELS[r.config], "none" if r.variant == "free" else r.variant]
            rows.append([*label, r.status, *["-"] * (len(heads) - 3)])
            continue
        b = base.get(r.variant)
        speed = passes = cpu = None
        if b is not None:
            speed = f"{(r.docs / r.wall_s) / (b.docs / b.wall_s):.2f}x"
            if r.cpu_s and b.cpu_s:
                cpu = f"{r.cpu_s / b.cpu_s:.2f}x"
            if r.forward_passes is not None and b.forward_passes:
                passes = f"{r.forward_passes / b.forward_passes:.2f}x"
        differ = None
        if r.differ_text is not None:
            differ = f"{r.differ_text}/{_fmt(r.differ_ids)}"
        rows.append(
            [
                LABELS[r.config],
                "none" if r.variant == "free" else r.variant,
                f"{r.wall_s:.1f}",
                f"{r.docs / r.wall_s:.2f}",
                f"{r.out_tokens / r.wall_s:.1f}",
                _fmt(r.cpu_s, "{:.1f}"),
                _fmt(r.forward_passes),
                _fmt(r.drafted),
                _fmt(r.accepted),
                f"{r.valid}/{r.docs}",
                f"{r.json_ok}/{r.docs}",
                f"{100 * r.correct_fields / max(1, r.total_fields):.0f}%",
                _fmt(differ),
                _fmt(speed),
                _fmt(cpu),
                _fmt(passes),
            ]
        )
    return markdown_table(heads, rows, right=range(2, len(heads)))


# ---------------------------------------------------------------------------- driver
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = make_parser(__doc__)
    p.add_argument("--num-docs", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="8 documents: a smoke run")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None,
                   help="sglite torch threads, llama-server -t (default: all cores)")  # fmt: skip
    p.add_argument("--grammar-backend", default="llguidance")
    p.add_argument("--variants", default="schema,regex", help="comma-separated: schema, regex")
    p.add_argument("--configs", default="none,exact,retokenize,free,llama",
                   help="comma-separated, run in this order: none (token-by-token), exact, "
                        "retokenize, free (unconstrained), llama")  # fmt: skip
    p.add_argument("--repeats", type=int, default=1,
                   help="time each batch N times, keep the best wall and CPU time")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="document generator seed")
    add_llama_server_option(p)
    p.add_argument("--llama-parallel", type=int, default=None,
                   help="llama-server -np slots (default: min(num docs, 64))")  # fmt: skip
    p.add_argument("--llama-ctx-per-slot", type=int, default=1024)
    add_json_option(p, "every run (with outputs)")
    args = p.parse_args(argv)
    args.resolved_dtype = None
    if args.quick:
        args.num_docs = 8
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for v in args.variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    for c in args.configs:
        if c not in LABELS:
            p.error(f"unknown configuration {c!r}; choose from {', '.join(LABELS)}")
    return args


def find_llama(args: argparse.Namespace) -> str | None:
    """The llama-server binary when the llama configuration is asked for (None: skipped)."""
    if "llama" not in args.configs:
        return None
    llama, why = find_llama_server(args.llama_server)
    if llama is None and args.llama_server:
        raise SystemExit(why)
    if llama is None:
        print(f"[llama] will be skipped: {why}")
    return llama


def main(argv: list[str] | None = None) -> None:
    """Run each configuration in turn and print the table."""
    args = parse_args(argv)
    print(f"command: {command_line(COMMAND)}", flush=True)
    docs = make_docs(args.num_docs, args.seed)
    llama = find_llama(args)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    runs: list[Run] = []
    for config in args.configs:
        if config == "llama":
            if llama is None:
                print("[llama] skipped: no llama-server binary")
                continue
            print(f"[llama] {llama} ({llama_build_line(llama)}), {len(docs)} documents ...")
            runs += bench_llama(llama, args, docs)
        else:
            print(f"[{config}] {LABELS[config]}, {len(docs)} documents ...", flush=True)
            runs += bench_sglite(config, args, docs)
    base = {r.variant: r for r in runs if r.config == "none"}
    for r in (r for r in runs if not r.status):
        score(r, docs)
        if r.config in ("exact", "retokenize") and r.variant in base:
            compare(r, base[r.variant], docs)

    import torch

    dtype = args.dtype if args.dtype != "auto" else f"auto = {args.resolved_dtype or '?'}"
    print()
    print(f"command: {command_line(COMMAND)}")
    print(
        f"commit {git_revision()}; machine: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}; dtype {dtype}; "
        f"{args.num_docs} documents, max_new_tokens {args.max_new_tokens}, greedy; "
        f"grammar backend {args.grammar_backend}; load average {load:.1f} at start, "
        f"{os.getloadavg()[0] if hasattr(os, 'getloadavg') else float('nan'):.1f} at end"
    )
    print(table(runs))
    if llama is not None and "llama" in args.configs:
        crashes = [r for r in runs if r.config == "llama" and r.status]
        state = "; ".join(f"{r.variant}: {r.status}" for r in crashes) or "ok"
        print(f"llama.cpp: {llama}, build {llama_build_line(llama)}: {state}")
    print(
        "valid: fits the constraint (jsonschema / re.fullmatch; for unconstrained, the schema). "
        "fields right: extracted values equal to the document's. differ: outputs unlike "
        "token-by-token's (exact must be 0). tbt = token-by-token."
    )
    exact = [r for r in runs if r.config == "exact" and r.variant in base]
    for r in exact:
        b = base[r.variant]
        ratio = (r.docs / r.wall_s) / (b.docs / b.wall_s)
        verdict = "met" if ratio >= 1.5 else "NOT met"
        cpu = f", {b.cpu_s / r.cpu_s:.2f}x less CPU time" if r.cpu_s and b.cpu_s else ""
        print(
            f"target exact jump-forward >= 1.5x token-by-token throughput ({r.variant}): "
            f"{ratio:.2f}x, {verdict}{cpu}"
        )
    for r in runs:
        for note in r.notes:
            print("WARNING: " + note)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in runs], f, indent=1)


if __name__ == "__main__":
    main()
