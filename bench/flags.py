"""Suite parameters as command-line flags.

A suite module declares its parameters as ``FLAGS``, a tuple of :class:`Flag`; ``python -m bench <suite> --help``
lists them, ``python -m bench e2e --batch 64 --drift 0`` sets them, and the suite's ``run(ctx)`` reads the parsed
values with :func:`values` (``ctx.params`` when the CLI ran it, the defaults when a test calls ``run_suite``
without parameters). A flag that several named suites declare (``--sweep``) applies to each of them; they must
declare it with the same type.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple


@dataclass(frozen=True)
class Flag:
    """One suite parameter.

    Args:
        name: the option, e.g. ``"--batch"``; the value is the attribute ``batch`` (dashes become underscores).
        default: the value when the flag is not given (None: the suite picks one, e.g. by device; ``help`` says how).
        help: what it changes, for ``--help``.
        type: ``bool`` (``--name`` / ``--no-name``) or a converter from the command-line string (``int``, ``str``,
            :func:`int_list`, ...; raise ``argparse.ArgumentTypeError`` for a clear usage error).
        choices: the allowed strings, if a fixed set.
        replaces: the environment variable this flag replaced (documentation only).
        metavar: the value's name in ``--help`` (default: the attribute's name in capitals).
    """

    name: str
    default: Any
    help: str
    type: Callable[[str], Any] = str
    choices: Optional[Tuple[str, ...]] = None
    replaces: str = ""
    metavar: Optional[str] = None

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    def add_to(self, group, default: Any) -> None:
        """Add the option to an argparse parser or group, with ``default`` (``argparse.SUPPRESS``: absent unless given)."""
        shown = _shown(self.default)
        shown = f" (default: {shown})" if shown else ""
        if self.type is bool:
            group.add_argument(self.name, dest=self.dest, action=argparse.BooleanOptionalAction, default=default,
                               help=self.help + shown)
        else:
            group.add_argument(self.name, dest=self.dest, type=self.type, choices=self.choices, default=default,
                               metavar=None if self.choices else self.metavar or self.dest.upper(), help=self.help + shown)


def _shown(default: Any) -> str:
    """A default as ``--help`` shows it: on / off, a comma-separated list, nothing for None or empty."""
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, (tuple, list)):
        return ",".join(str(x) for x in default)
    return "" if default is None else str(default)


def defaults(flags: Iterable[Flag]) -> SimpleNamespace:
    """Every flag at its default."""
    return SimpleNamespace(**{f.dest: f.default for f in flags})


def values(ctx, flags: Iterable[Flag]) -> SimpleNamespace:
    """The suite's parameters: ``ctx.params`` (set by the CLI or a test), else every flag's default."""
    params = getattr(ctx, "params", None)
    return params if params is not None else defaults(flags)


def add_suite_flags(parser: argparse.ArgumentParser, suites: Sequence[Tuple[str, Sequence[Flag]]]) -> None:
    """One argument group per suite; a flag declared by several suites is added once (same type required).
    Defaults are suppressed: :func:`suite_values` fills each suite's own."""
    owners: Dict[str, List[str]] = {}
    for suite, flags in suites:
        for flag in flags:
            owners.setdefault(flag.name, []).append(suite)
    seen: Dict[str, Tuple[str, Flag]] = {}
    for suite, flags in suites:
        group = None
        for flag in flags:
            if flag.name in seen:
                owner, first = seen[flag.name]
                if (first.type, first.choices) != (flag.type, flag.choices):
                    raise ValueError(f"suites {owner} and {suite} declare {flag.name} with different types")
                continue
            if group is None:
                group = parser.add_argument_group(f"suite {suite}")
            if len(owners[flag.name]) > 1:
                flag = replace(flag, help=f"{flag.help} [applies to {', '.join(owners[flag.name])}]")
            flag.add_to(group, argparse.SUPPRESS)
            seen[flag.name] = (suite, flag)


def suite_values(namespace: argparse.Namespace, flags: Iterable[Flag]) -> SimpleNamespace:
    """One suite's parameters from a namespace parsed by a parser built with :func:`add_suite_flags`."""
    return SimpleNamespace(**{f.dest: getattr(namespace, f.dest, f.default) for f in flags})


def parse(flags: Sequence[Flag], argv: List[str], prog: str = "suite") -> SimpleNamespace:
    """``argv`` parsed against ``flags`` alone (tests; a usage error raises SystemExit(2) as argparse does)."""
    parser = argparse.ArgumentParser(prog=prog)
    add_suite_flags(parser, [(prog, flags)])
    return suite_values(parser.parse_args(argv), flags)


# -- converters ------------------------------------------------------------------------------------
def str_list(text: str) -> Tuple[str, ...]:
    """``"a, b,c"`` -> ``("a", "b", "c")`` (empty items dropped)."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def int_list(text: str) -> Tuple[int, ...]:
    """``"1,16,64"`` -> ``(1, 16, 64)``."""
    try:
        return tuple(int(item) for item in str_list(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _checked(text: str, kind, ok, expected: str):
    """``kind(text)`` when ``ok`` holds for it, else an argparse error saying what was ``expected``."""
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    return _checked(text, int, lambda v: v >= 0, "an integer >= 0")


def unit_fraction(text: str) -> float:
    """A number in (0, 1]."""
    return _checked(text, float, lambda v: 0.0 < v <= 1.0, "a number in (0, 1]")


def fraction(text: str) -> float:
    """A number in [0, 1]."""
    return _checked(text, float, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")


def loss_budgets(text: str) -> Tuple[Optional[float], ...]:
    """Comma-separated fractions in [0, 1) or ``none`` (no budget), e.g. ``0.01,none``."""
    out = []
    for item in text.split(","):
        item = item.strip()
        out.append(None if item == "none" else _checked(item, float, lambda v: 0.0 <= v < 1.0,
                                                        "a number in [0, 1) or none"))
    return tuple(out)


def positive_float(text: str) -> float:
    """A finite number > 0."""
    return _checked(text, float, lambda v: 0.0 < v < float("inf"), "a finite number > 0")


def positive_int(text: str) -> int:
    return _checked(text, int, lambda v: v >= 1, "an integer >= 1")


# The engines' prefill buckets (SpeculativeEngine(prefill_lengths=)) of the suites that run a real model's prompts.
PREFILL_LENGTHS_FLAG = Flag(
    "--prefill-lengths", (64, 128, 256, 512, 1024), "comma-separated prompt-length buckets whose prefill every "
    "engine replays from a CUDA graph (SpeculativeEngine(prefill_lengths=); a bucket past an engine's capacity "
    "becomes that capacity); '' runs the eager prefill", int_list, metavar="LIST")


SELECTOR_MIN_GAIN_FLAG = Flag(
    "--selector-min-gain", 0.0, "the adaptive selector plays a speculative arm only when it predicts more than 1 + "
    "this times plain decoding's throughput (CostModelPolicy(min_gain=); docs/RUNTIME.md, \"Static batches\")",
    fraction, metavar="FRACTION")


SELECTOR_LOSS_BUDGET_FLAG = Flag(
    "--selector-loss-budget", None, "the adaptive selector's loss budget (StrategySelector(loss_budget=): the most a "
    "rollout's speculative steps may lose against plain decoding, a fraction of its time; none: no budget; default: "
    "the selector's); more values add rows of the same engines with those budgets, named `<drafter> adaptive "
    "[budget X]` (docs/RUNTIME.md, \"The loss budget\")", loss_budgets, metavar="LIST")


SELECTOR_FORECAST_FLAG = Flag(
    "--selector-forecast", False, "also run every budgeted adaptive row with the requests' acceptance forecast "
    "(StrategySelector(forecast=AcceptanceForecast()): where the budget plays plain decoding, an arm whose slowest "
    "running request's forecast beats it by 5% runs), named `<drafter> adaptive [budget X, forecast]` "
    "(docs/RUNTIME.md, \"The forecast\")", bool)


SELECTOR_COUNTERFACTUAL_FLAG = Flag(
    "--selector-counterfactual", True, "also run the n-gram engine with the counterfactual policy "
    "(StrategySelector(policy='counterfactual'): every arm's drafts scored at every step, the arm of the best mean "
    "tokens per second played), named `ngram adaptive [counterfactual]`, cold and warm (docs/RUNTIME.md, \"The "
    "counterfactual policy\"); --no-selector-counterfactual: skip them", bool)


def prefill_buckets(lengths: Sequence[int], capacity: int) -> Tuple[int, ...]:
    """``lengths`` with each bucket past ``capacity`` (an engine's ``max_seq_len``) cut to it: such a bucket holds
    any prompt the engine can take."""
    return tuple(sorted({min(length, capacity) for length in lengths}))
