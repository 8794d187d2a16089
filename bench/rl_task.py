"""The RL suite's verifiable task: arithmetic word problems with exact integer answers, generated from a seed.

A problem is a short story with two or three numbers and one of +, -, x; its reward is 1 when the last integer in
the response equals the answer, else 0 (:func:`reward`). Generated, never downloaded, so a run is reproducible
from its seed and needs no data files.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import List

_TEMPLATES = (
    ("{name} has {a} {thing}. {pronoun} buys {b} more. How many {thing} does {name} have now?", lambda a, b: a + b),
    ("{name} had {a} {thing} and gave {b} of them to a friend. How many {thing} are left?", lambda a, b: a - b),
    ("{name} fills {a} boxes with {b} {thing} each. How many {thing} is that in all?", lambda a, b: a * b),
    ("A shelf holds {a} {thing}. {name} adds {b} and then {c} more. How many {thing} are on the shelf?",
     lambda a, b, c: a + b + c),
)
_NAMES = (("Tom", "He"), ("Ana", "She"), ("Lee", "He"), ("Mia", "She"), ("Sam", "He"), ("Zoe", "She"))
_THINGS = ("apples", "books", "marbles", "stamps", "pencils", "shells")
_LAST_INTEGER = re.compile(r"-?\d[\d,]*")


@dataclass(frozen=True)
class Problem:
    question: str
    answer: int

    def chat(self) -> List[dict]:
        """The chat messages a chat template turns into the prompt."""
        return [{"role": "user", "content": self.question + " Answer with the number at the end."}]


def problems(count: int, seed: int) -> List[Problem]:
    """``count`` problems from ``seed`` (operands 2..40; subtraction never goes below 0)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        text, solve = rng.choice(_TEMPLATES)
        name, pronoun = rng.choice(_NAMES)
        numbers = [rng.randint(2, 40) for _ in range(solve.__code__.co_argcount)]
        if solve.__code__.co_argcount == 2 and solve(2, 1) == 1:  # subtraction: the larger number first
            numbers.sort(reverse=True)
        fields = dict(zip("abc", numbers), name=name, pronoun=pronoun, thing=rng.choice(_THINGS))
        out.append(Problem(text.format(**fields), solve(*numbers)))
    return out


def reward(response: str, answer: int) -> float:
    """1.0 when the last integer in ``response`` (commas allowed as thousands separators) equals ``answer``."""
    found = _LAST_INTEGER.findall(response)
    if not found:
        return 0.0
    try:
        return float(int(found[-1].replace(",", "")) == answer)
    except ValueError:
        return 0.0
