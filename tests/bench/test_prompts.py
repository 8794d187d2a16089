"""The prompt set of the real-model benchmarks (bench/data/prompts.jsonl) and its loader, bench.prompts: the shipped
file's data contract (sizes, splits, ids, math answers) and the loader's validation and filters."""
import ast
import json
import re
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `bench` is a top-level folder, not part of the installed package
    sys.path.insert(0, str(ROOT))

from bench.prompts import CATEGORIES, PROMPTS_PATH, SPLITS, Prompt, load_prompts  # noqa: E402

PER_CATEGORY, HELDOUT_PER_CATEGORY = 16, 4


@pytest.fixture(scope="module")
def prompts():
    return load_prompts()


def test_shipped_file_loads_with_every_category(prompts):
    assert PROMPTS_PATH.is_file()
    counts = Counter(p.category for p in prompts)
    assert set(counts) == set(CATEGORIES)
    assert all(n >= PER_CATEGORY for n in counts.values()), counts
    assert all(isinstance(p, Prompt) and p.split in SPLITS for p in prompts)


def test_heldout_is_at_least_four_per_category_and_not_just_the_tail(prompts):
    for category in CATEGORIES:
        ids = [p.id for p in prompts if p.category == category]
        heldout = [p.id for p in prompts if p.category == category and p.split == "heldout"]
        assert len(heldout) >= HELDOUT_PER_CATEGORY, (category, heldout)
        assert len(ids) - len(heldout) >= PER_CATEGORY - HELDOUT_PER_CATEGORY, category
        assert set(heldout) != set(ids[-len(heldout):]), f"{category}: heldout is the last prompts, not spread"


def test_ids_are_unique_and_named_after_their_category(prompts):
    ids = [p.id for p in prompts]
    assert len(ids) == len(set(ids))
    assert all(re.fullmatch(re.escape(p.category) + r"-\d{2}", p.id) for p in prompts)


def test_messages_end_with_a_user_turn_and_are_not_shared(prompts):
    for p in prompts:
        assert p.messages[-1]["role"] == "user" and p.messages[-1]["content"].strip(), p.id
        assert [m["role"] for m in p.messages[:-1]] in ([], ["system"]), p.id
    chat = prompts[0].chat()
    chat.append({"role": "assistant", "content": "x"})
    chat[0]["content"] = "changed"
    assert load_prompts()[0].chat() == list(prompts[0].messages) != chat


def test_math_answers_are_ints_and_not_leaked(prompts):
    math = [p for p in prompts if p.category == "math"]
    for p in math:
        assert type(p.answer) is int, p.id
        text = " ".join(m["content"] for m in p.messages)
        assert "The answer is N." in text, f"{p.id}: the prompt must ask for the final 'The answer is N.'"
        leak = re.compile(r"answer\s+is\s*[:=]?\s*\$?\s*" + str(p.answer) + r"\b",
                          re.IGNORECASE)
        assert not leak.search(text.replace(",", "")), f"{p.id}: the prompt gives away its answer"
    assert all(p.answer is None for p in prompts if p.category != "math")


def test_code_edit_prompts_carry_a_snippet_to_edit(prompts):
    """The category exists for prompts whose answer copies the input: each holds a 10-40 line fenced snippet."""
    for p in (p for p in prompts if p.category == "code-edit"):
        blocks = re.findall(r"```[\w+-]*\n(.*?)```", p.messages[-1]["content"], re.DOTALL)
        assert len(blocks) == 1 and 10 <= blocks[0].rstrip("\n").count("\n") + 1 <= 40, p.id


def test_filters(prompts):
    train, heldout = load_prompts(split="train"), load_prompts(split="heldout")
    assert {p.split for p in train} == {"train"} and {p.split for p in heldout} == {"heldout"}
    assert len(train) + len(heldout) == len(prompts)
    assert not {p.id for p in train} & {p.id for p in heldout}
    math = load_prompts(categories=["math"])
    assert math == load_prompts(categories="math") and {p.category for p in math} == {"math"}
    both = load_prompts(split="heldout", categories=("code", "code-edit"))
    assert both == [p for p in heldout if p.category in ("code", "code-edit")]
    assert load_prompts(categories=[]) == []


@pytest.mark.parametrize("kw, named", [({"split": "test"}, "split"), ({"split": "Train"}, "split"),
                                       ({"categories": ["math", "poetry"]}, "categories")])
def test_bad_filter_arguments_raise(kw, named):
    with pytest.raises(ValueError, match=named):
        load_prompts(**kw)


def _good(**over):
    row = {"id": "math-01", "category": "math", "split": "train",
           "messages": [{"role": "user", "content": "What is 2 + 3? End with \"The answer is N.\""}], "answer": 5}
    row.update(over)
    return {k: v for k, v in row.items() if v is not _DROP}


_DROP = object()
_USER = [{"role": "user", "content": "hi"}]
BAD_LINES = {
    "unknown category": (_good(category="poetry", id="poetry-01"), "category"),
    "unknown split": (_good(split="dev"), "split"),
    "missing messages": (_good(messages=_DROP), "messages"),
    "empty messages": (_good(messages=[]), "messages"),
    "message without content": (_good(messages=[{"role": "user"}]), "messages"),
    "unknown role": (_good(messages=[{"role": "bot", "content": "hi"}]), "messages"),
    "system not first": (_good(messages=_USER + [{"role": "system", "content": "be brief"}]), "messages"),
    "ends with assistant": (_good(messages=_USER + [{"role": "assistant", "content": "hello"}]), "messages"),
    "math without answer": (_good(answer=_DROP), "answer"),
    "math answer not int": (_good(answer="5"), "answer"),
    "math answer float": (_good(answer=5.0), "answer"),
    "math answer bool": (_good(answer=True), "answer"),
    "answer outside math": (_good(id="chat-01", category="chat", answer=3), "answer"),
    "missing id": (_good(id=_DROP), "id"),
    "id of another category": (_good(id="chat-01"), "id"),
    "unknown field": (_good(anwser=5), "anwser"),
    "not an object": ([1, 2], "line"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_line_names_file_line_and_field(tmp_path, case):
    row, named = BAD_LINES[case]
    path = tmp_path / "prompts.jsonl"
    good = json.dumps(_good(id="math-07"))
    path.write_text(f"{good}\n\n{json.dumps(row)}\n")  # the blank line 2 is skipped; the bad line is line 3
    with pytest.raises(ValueError) as err:
        load_prompts(path)
    message = str(err.value)
    assert f"{path}:3:" in message and f"field {named!r}" in message, message


def test_duplicate_id_and_invalid_json_name_their_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(_good()) + "\n" + json.dumps(_good()) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: field 'id': duplicate id 'math-01' (first on line 1)")):
        load_prompts(path)
    path.write_text(json.dumps(_good()) + "\n{\"id\": \"math-02\",\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: field 'line': not valid JSON")):
        load_prompts(path)


def test_a_valid_small_file_loads_with_system_message(tmp_path):
    path = tmp_path / "p.jsonl"
    row = _good(id="story-03", category="story", split="heldout", answer=_DROP,
                messages=[{"role": "system", "content": "Be vivid."}, {"role": "user", "content": "A story."}])
    path.write_text(json.dumps(row) + "\n" + json.dumps(_good()) + "\n")
    story, math = load_prompts(str(path))
    assert (story.id, story.split, story.answer, len(story.messages)) == ("story-03", "heldout", None, 2)
    assert (math.answer, hash(math) == hash(load_prompts(path)[1])) == (5, True)


def test_loader_stays_light():
    """bench.prompts is read by data tooling that must not pull in torch: it imports only the standard library."""
    tree = ast.parse((ROOT / "bench" / "prompts.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                 and node.module}
    assert imported <= {"__future__", "json", "re", "dataclasses", "pathlib", "typing"}, imported
