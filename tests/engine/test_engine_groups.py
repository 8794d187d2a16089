"""``generate(..., groups=)``: the n-gram drafter drafts from a request's whole group (GRPO's responses to one
prompt), finished siblings included; the output law does not change (greedy: plain decoding's tokens)."""
import pytest
import torch

from tlt_kernels.drafter import Drafter
from tlt_kernels.engine import SpeculativeEngine
from tlt_kernels.engine.groups import sibling_table
from tlt_kernels.models import reference_generate
from tlt_kernels.runtime import Strategy


def test_sibling_table():
    table = sibling_table(["a", "b", "a", "a", "c"], 5, "cpu")
    assert table.tolist() == [[2, 3], [-1, -1], [0, 3], [0, 2], [-1, -1]]
    assert sibling_table([0, 1], 2, "cpu").shape == (2, 0)
    assert sibling_table(None, 3, "cpu") is None
    with pytest.raises(ValueError, match="one group id per request"):
        sibling_table([0, 0], 3, "cpu")


def test_a_straggler_drafts_from_a_finished_siblings_text(target):
    """Request 1 of the group already holds request 0's greedy continuation (its prompt is request 0's prompt plus
    that text) and finishes at once; request 0 then drafts from it: fewer steps than self-only n-gram, and the
    same tokens as plain decoding (the drafts change no output)."""
    from tlt_kernels.models import load_corpus
    from tlt_kernels.models.train_tiny import sample_windows

    prompt = sample_windows(load_corpus("base", 200_000), 6, 16, torch.Generator().manual_seed(1))[1, :8].tolist()
    continuation = reference_generate(target, [prompt], 30).tokens[0].tolist()
    batch, max_new = [prompt, prompt + continuation], [30, 1]
    eng = SpeculativeEngine(target, "ngram", Strategy(6, 1, 7), max_batch_size=4, max_seq_len=80)
    alone = eng.generate(batch, max_new)
    grouped = eng.generate(batch, max_new, groups=["p", "p"])
    assert grouped.tokens[0] == alone.tokens[0] == continuation
    assert len(grouped.steps) < len(alone.steps)


def test_groups_are_checked_before_the_rollout(target):
    eng = SpeculativeEngine(target, "ngram", Strategy(3, 1, 4), max_batch_size=4, max_seq_len=40)
    with pytest.raises(ValueError, match="one group id per request"):
        eng.generate([[1, 2, 3], [4, 5]], 4, groups=[0])
    plain = SpeculativeEngine(target, None, Strategy.off(), max_batch_size=4, max_seq_len=40)
    assert plain.generate([[1, 2, 3], [4, 5]], 4, groups=[0, 0]).tokens  # a drafter without groups ignores them


class _WithoutGroups:
    """A Drafter written against the protocol alone (no DrafterBase, no ``set_groups``): forwards everything else to
    the n-gram drafter. The protocol's attributes are set on the instance and its methods defined on the class
    (below), since Python 3.12's protocol check looks members up statically and never calls ``__getattr__``."""

    def __init__(self, inner):
        self._inner = inner
        for name in Drafter.__annotations__:
            setattr(self, name, getattr(inner, name))

    def __getattr__(self, name):
        if name == "set_groups":
            raise AttributeError(name)
        return getattr(self._inner, name)


def _forwarded(name):
    return lambda self, *args, **kwargs: getattr(self._inner, name)(*args, **kwargs)


for _name in [n for n in vars(Drafter) if not n.startswith("_")]:
    setattr(_WithoutGroups, _name, _forwarded(_name))


def test_a_drafter_without_set_groups_takes_groups_as_self_only(target):
    from tlt_kernels.drafter.ngram_rollout import NGramRolloutDrafter

    batch = [[1, 2, 3, 1, 2], [4, 5, 4, 5]]
    own = SpeculativeEngine(target, _WithoutGroups(NGramRolloutDrafter()), Strategy(3, 1, 4), max_batch_size=4,
                            max_seq_len=40)
    assert not hasattr(own.tree_drafter, "set_groups")
    alone = own.generate(batch, 6)
    assert own.generate(batch, 6, groups=[0, 0]).tokens == alone.tokens == reference_generate(target, batch, 6).as_lists()
