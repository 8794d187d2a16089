"""The group-drafting suite (``python -m bench group-drafting``): its tiny CPU run, the groups it hands the engine,
and its usage errors."""
import json

import pytest

from bench.__main__ import main


def _rows(out_dir) -> list:
    return json.loads((out_dir / "group-drafting.json").read_text())["rows"]


def _record_generate_groups(monkeypatch) -> list:
    """A list that receives ``(number of prompts, groups)`` of every ``SpeculativeEngine.generate`` call."""
    from tlt_kernels.engine import SpeculativeEngine

    calls = []
    real = SpeculativeEngine.generate

    def recording(self, prompts, *args, **kwargs):
        calls.append((len(prompts), kwargs.get("groups")))
        return real(self, prompts, *args, **kwargs)

    monkeypatch.setattr(SpeculativeEngine, "generate", recording)
    return calls


def test_every_case_has_plain_and_each_arm_with_and_without_groups(tmp_path, monkeypatch):
    """Per (G, P): a plain row and a self and a group row per arm, every one with all its tokens (EOS off on the tiny
    model); plain accepts nothing; the group rows hand the engine each request's group id (requests of one problem
    share it), the others none, on the warm-up and the timed rollout alike."""
    calls = _record_generate_groups(monkeypatch)
    argv = ["group-drafting", "--small", "--device", "cpu", "--out", str(tmp_path), "--group-sizes", "2,3",
            "--prompts", "1,2", "--arms", "s2k1v3", "--max-new-tokens", "6"]
    assert main(argv) == 0
    rows = _rows(tmp_path)
    cases = {(r["case"]["G"], r["case"]["P"]) for r in rows}
    assert cases == {(2, 1), (2, 2), (3, 1), (3, 2)}
    for g, p in cases:
        impls = {r["impl"]: r for r in rows if (r["case"]["G"], r["case"]["P"]) == (g, p)}
        assert set(impls) == {"plain", "self s2k1v3", "group s2k1v3"}
        assert all(r["case"]["B"] == g * p and r["tokens"] == g * p * 6 for r in impls.values())
        assert impls["plain"]["accepted_length"] == 1.0
        assert all(1.0 <= r["accepted_length"] <= 3.0 for r in impls.values())
    # 3 ways x 4 cases x (warm-up + 1 timed rollout), in the suite's order: ways, then G, then P.
    assert len(calls) == 24
    group_calls = calls[16:]
    expected = [(g * p, [i // g for i in range(g * p)]) for g in (2, 3) for p in (1, 2) for _ in range(2)]
    assert group_calls == expected
    assert all(groups is None for _, groups in calls[:16])


@pytest.mark.parametrize("flag, value", [("--group-sizes", "1"), ("--group-sizes", "17"), ("--arms", "off"),
                                         ("--temperature", "0")])
def test_bad_settings_fail_naming_the_flag(tmp_path, capsys, flag, value):
    argv = ["group-drafting", "--small", "--device", "cpu", "--out", str(tmp_path), flag, value]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert flag in captured.out + captured.err
