"""The prompt set of the real-model benchmarks: ``bench/data/prompts.jsonl``.

What it is for: the end-to-end benchmark on a real model (a small instruct model such as SmolLM2-135M-Instruct
answers each prompt through its chat template, 256-1024 new tokens) and the training and evaluation of a
speculative drafter on those answers. Six categories (:data:`CATEGORIES`) cover the kinds of traffic that drafting
sees: open ``chat``; ``code`` written from a precise spec; ``code-edit``, a 10-40 line snippet to change, so the
answer copies much of the prompt (what n-gram drafting exploits); ``math`` word problems with an exact integer
``answer`` (for a reward that parses the final "The answer is N."); ``summary`` of a passage given in the prompt;
and long ``story`` writing. All prompts were written for this set.

How it is split: each category holds 16 or more prompts, 4 of them ``"heldout"`` (spread through the category, not
its last ones) and the rest ``"train"``. Train a drafter on the answers to the train prompts and report its
acceptance on the heldout ones.

One JSON object per line: ``id`` (``<category>-<nn>``), ``category``, ``split``, ``messages`` (chat messages, an
optional ``system`` message first and a ``user`` message last) and, for math only, ``answer`` (an int).
:func:`load_prompts` validates every line and raises ``ValueError`` naming the file, the line and the field.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

PROMPTS_PATH = Path(__file__).resolve().parent / "data" / "prompts.jsonl"
CATEGORIES: Tuple[str, ...] = ("chat", "code", "code-edit", "math", "summary", "story")
SPLITS: Tuple[str, ...] = ("train", "heldout")
FIELDS = frozenset({"id", "category", "split", "messages", "answer"})
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Prompt:
    """One prompt of the set; ``messages`` is ready for a tokenizer's ``apply_chat_template``."""

    id: str
    category: str
    split: str
    messages: Tuple[Dict[str, str], ...] = field(hash=False)
    answer: Optional[int] = None

    def chat(self) -> List[Dict[str, str]]:
        """The messages as a fresh list of fresh dicts (safe to modify, e.g. to append the model's reply)."""
        return [dict(m) for m in self.messages]


def _check_messages(messages: Any) -> Optional[str]:
    """Why ``messages`` is not a valid chat (None when it is): a non-empty list of {role, content} dicts."""
    if not isinstance(messages, list) or not messages:
        return "must be a non-empty list of messages"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            return f"message {i} must be an object with exactly 'role' and 'content'"
        if m["role"] not in ROLES:
            return f"message {i} has unknown role {m['role']!r} (expected one of {ROLES})"
        if m["role"] == "system" and i != 0:
            return f"message {i}: a system message may only come first"
        if not isinstance(m["content"], str) or not m["content"].strip():
            return f"message {i} has empty or non-string content"
    if messages[-1]["role"] != "user":
        return "the last message must be from the user"
    return None


def _problem(obj: Any) -> Optional[Tuple[str, str]]:
    """The first problem of one parsed line as (field, message), or None when the line is valid."""
    if not isinstance(obj, dict):
        return "line", "must be a JSON object"
    unknown = sorted(set(obj) - FIELDS)
    if unknown:
        return unknown[0], f"unknown field (expected only {sorted(FIELDS)})"
    for name in ("id", "category", "split", "messages"):
        if name not in obj:
            return name, "missing"
    if obj["category"] not in CATEGORIES:
        return "category", f"unknown category {obj['category']!r} (expected one of {CATEGORIES})"
    if obj["split"] not in SPLITS:
        return "split", f"unknown split {obj['split']!r} (expected one of {SPLITS})"
    if not isinstance(obj["id"], str) or not re.fullmatch(re.escape(obj["category"]) + r"-\d{2,}", obj["id"]):
        return "id", f"{obj['id']!r} is not '<category>-<nn>' for category {obj['category']!r}"
    why = _check_messages(obj["messages"])
    if why:
        return "messages", why
    answer = obj.get("answer")
    if obj["category"] == "math" and (type(answer) is not int):
        return "answer", f"a math prompt needs an integer answer, got {answer!r}"
    if obj["category"] != "math" and "answer" in obj:
        return "answer", "only math prompts have an answer"
    return None


def _parse(path: Path) -> List[Prompt]:
    """Every prompt of the file, validated; raises ValueError naming the file, line number and field."""
    prompts: List[Prompt] = []
    seen: Dict[str, int] = {}
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: field 'line': not valid JSON ({e.msg})") from None
        problem = _problem(obj)
        if problem is None and obj["id"] in seen:
            problem = ("id", f"duplicate id {obj['id']!r} (first on line {seen[obj['id']]})")
        if problem is not None:
            raise ValueError(f"{path}:{lineno}: field {problem[0]!r}: {problem[1]}")
        seen[obj["id"]] = lineno
        prompts.append(Prompt(obj["id"], obj["category"], obj["split"],
                              tuple(dict(m) for m in obj["messages"]), obj.get("answer")))
    return prompts


def load_prompts(path: Union[str, Path, None] = None, split: Optional[str] = None,
                 categories: Union[str, Iterable[str], None] = None) -> List[Prompt]:
    """The prompts of ``path`` (default :data:`PROMPTS_PATH`), in file order.

    ``split``: None for all, else ``"train"`` or ``"heldout"``. ``categories``: None for all, else one category
    name or an iterable of names from :data:`CATEGORIES`. Raises ValueError for an unknown split or category, and
    for any invalid line of the file (naming the file, line number and field).
    """
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be None or one of {SPLITS}, got {split!r}")
    wanted: Optional[frozenset] = None
    if categories is not None:
        wanted = frozenset((categories,) if isinstance(categories, str) else categories)
        unknown = sorted(wanted - set(CATEGORIES))
        if unknown:
            raise ValueError(f"categories: unknown {unknown} (expected names from {CATEGORIES})")
    prompts = _parse(Path(path) if path is not None else PROMPTS_PATH)
    return [p for p in prompts
            if (split is None or p.split == split) and (wanted is None or p.category in wanted)]
