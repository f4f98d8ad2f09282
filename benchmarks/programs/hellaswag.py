"""HellaSwag-style 20-shot sentence completion (the paper's HellaSwag workload).

Models: Zellers et al.'s HellaSwag: a short description of an everyday activity whose last
sentence is cut off, and four candidate endings; the model picks the most likely ending with
`select` (length-normalised log-likelihood, as HellaSwag is scored). 20 solved examples come
first, as in the paper's 20-shot setting.

Data: synthesised activities (a person, a setting, the start of an action and its true
ending); the three wrong endings are true endings of other activities, as in HellaSwag's
adversarial distractors. No download.

Sharing: one 20-shot context (about 600 tokens) shared by every request; each request adds its
own context (about 20 tokens) and four endings scored from the same prefix (`select` sends the
prefix once and scores the four continuations from the cache).
"""

from __future__ import annotations

from typing import Any

import sglite as sgl
from benchmarks.programs.base import Workload
from benchmarks.programs.common import assert_ok, get_var, rng_for

NUM_SHOTS = 20
NUM_ENDINGS = 4
PEOPLE = [("A man", "He"), ("A woman", "She"), ("A young girl", "She"), ("An old man", "He"),
          ("A boy", "He"), ("A chef", "She")]  # fmt: skip
# (where the person is and what they begin to do, how the activity goes on)
ACTIVITIES = [
    ("is standing at a kitchen counter with a cutting board. {p} picks up a knife and",
     "slices the carrots into thin, even pieces."),
    ("is kneeling next to a bicycle in a garage. {p} removes the front wheel and",
     "patches the small hole in the inner tube."),
    ("is outside in a snowy yard holding a shovel. {p} pushes the shovel forward and",
     "clears a narrow path to the front door."),
    ("is sitting at a piano in a bright room. {p} places both hands on the keys and",
     "plays a slow, gentle melody."),
    ("is standing by a lake with a fishing rod. {p} swings the rod back and",
     "casts the line far out over the water."),
    ("is in a bathroom in front of a mirror. {p} squeezes toothpaste onto a brush and",
     "brushes the back teeth carefully."),
    ("is on a ladder next to a wall with a paint roller. {p} dips the roller in the tray and",
     "rolls blue paint across the wall."),
    ("is in a park holding a leash. {p} unclips the leash from the dog's collar and",
     "throws a ball for the dog to chase."),
    ("is in a laundry room with a basket of clothes. {p} opens the washing machine and",
     "loads the clothes into the drum."),
    ("is at a table with a sheet of paper and scissors. {p} folds the paper in half and",
     "cuts out the shape of a heart."),
    ("is in a garden wearing gloves. {p} digs a small hole in the soil and",
     "plants a tomato seedling in it."),
    ("is standing in a gym beside a barbell. {p} bends down, grips the bar and",
     "lifts it slowly up to the chest."),
    ("is at a sink full of dirty dishes. {p} turns on the hot water and",
     "scrubs each plate with a sponge."),
    ("is on a beach holding a surfboard. {p} paddles out past the breaking waves and",
     "stands up to ride a wave to the shore."),
    ("is in a living room with a Christmas tree. {p} opens a box of ornaments and",
     "hangs them one by one on the branches."),
    ("is at a desk in front of a laptop. {p} opens a new document and",
     "types the first lines of a letter."),
    ("is in a barn next to a brown horse. {p} picks up a brush and",
     "grooms the horse's mane with long strokes."),
    ("is in front of a car with the hood open. {p} pulls out the dipstick and",
     "checks the oil level against the marks."),
    ("is at a bakery counter with a bowl of dough. {p} sprinkles flour on the counter and",
     "kneads the dough until it is smooth."),
    ("is on a tennis court holding a racket. {p} tosses the ball into the air and",
     "serves it hard over the net."),
    ("is in a bedroom with an unmade bed. {p} pulls the sheets tight and",
     "tucks the corners under the mattress."),
    ("is on a sidewalk next to a window. {p} sprays cleaner on the glass and",
     "wipes it dry with a cloth."),
    ("is at a campsite with a pile of wood. {p} strikes a match and",
     "lights the kindling under the logs."),
    ("is in a salon with a customer in the chair. {p} combs the customer's hair and",
     "trims the ends with small scissors."),
]  # fmt: skip


def _activity(person: int, activity: int) -> tuple[str, str]:
    """The context (cut mid-sentence) and its true ending."""
    name, pronoun = PEOPLE[person]
    start, ending = ACTIVITIES[activity]
    return f"{name} {start.format(p=pronoun)}", ending


def few_shot_prefix(seed: int) -> str:
    """20 solved examples, each a context followed by its true ending."""
    rng = rng_for(seed, "hellaswag-shots")
    shots = rng.sample(range(len(ACTIVITIES)), NUM_SHOTS)
    lines = [" ".join(_activity(rng.randrange(len(PEOPLE)), a)) for a in shots]
    return "Complete each description with the most likely ending.\n\n" + "\n\n".join(lines)


@sgl.function
def hellaswag(s, few_shot, context, endings):
    s += few_shot + "\n\n" + context
    s += sgl.select("answer", choices=endings)


def make_args(num_requests: int, seed: int) -> list[dict[str, Any]]:
    """`num_requests` contexts, each with its true ending among 4 shuffled endings."""
    prefix = few_shot_prefix(seed)
    args = []
    for i in range(num_requests):
        rng = rng_for(seed, "hellaswag-question", i)
        activity = rng.randrange(len(ACTIVITIES))
        context, ending = _activity(rng.randrange(len(PEOPLE)), activity)
        others = rng.sample([a for a in range(len(ACTIVITIES)) if a != activity], 3)
        # A leading space: the ending continues the sentence the context cut off.
        endings = [" " + ending] + [" " + ACTIVITIES[a][1] for a in others]
        rng.shuffle(endings)
        args.append({"few_shot": prefix, "context": context, "endings": endings})
    return args


def check(state: Any, args: dict[str, Any]) -> None:
    """The answer is one of the request's four endings."""
    assert_ok(state)
    assert len(args["endings"]) == NUM_ENDINGS, "endings: expected 4"
    answer = get_var(state, "answer")
    assert answer in args["endings"], f"'answer': {answer!r} is not one of the endings"


WORKLOAD = Workload(
    name="hellaswag",
    description="HellaSwag-style 20-shot select over 4 sentence endings (one shared context)",
    program=hellaswag,
    make_args=make_args,
    check=check,
    shared_prefix=True,
    default_num_requests=200,
    quick_num_requests=16,
)
