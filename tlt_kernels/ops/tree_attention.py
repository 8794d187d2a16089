"""Tree attention over a paged KV cache: plan once per decoding step, run once per layer.

Usage::

    plan = plan_tree_attention(parents, context_lens, block_table, num_nodes,
                               num_q_heads=28, num_kv_heads=4, head_dim=128, block_size=16)
    for layer in layers:
        o = plan.run(q, k_cache[layer], v_cache[layer])      # no host sync, CUDA-graph capturable

or, for a single call, :func:`tree_attention` (builds a plan and runs it once).

The plan (:class:`TreeAttentionPlan`) is the contract shared by the Triton and CUDA backends: it
holds the bit-packed ancestor mask, int32 copies of the per-request tables, the flash-decoding split
(``num_splits`` context splits of ``split_len`` tokens) and fp32 scratch for the partial results.
See ``docs/TREE_ATTENTION.md`` for the algorithm and the work split.
"""
from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .._backend import backend_unavailable_reason, cuda_sm_count, direct_dispatch_ok, register_op
from .._validation import FP8_DTYPES, check_tensor, dense, per_request, saturate_to
from ..reference.tree_attention import run_torch
from ..tree import pack_tree_mask, resolve_num_nodes, tree_ancestor_mask_packed, validate_tree

__all__ = ["TreeAttentionPlan", "plan_masked_attention", "plan_tree_attention", "run", "tree_attention"]

_BACKENDS = register_op(
    "tree_attention",
    {
        "torch": "tlt_kernels.reference.tree_attention:run_torch",
        "triton": "tlt_kernels._triton.tree_attention:run_triton",
        "cuda": "tlt_kernels._cuda.tree_attention:run_cuda",
    },
    # Triton first: as fast or faster than the CUDA backend on most suite cases, and still ahead at T=8 on one of
    # the two cards measured (docs/TREE_ATTENTION.md, "Measurements behind the defaults"). Swap (or choose per
    # shape) when the CUDA backend leads on both cards.
    preference=("triton", "cuda", "torch"),
)

KERNEL_HEAD_DIMS = (64, 128, 256)
KERNEL_MAX_NODES = 64
MAX_BLOCK_SIZE = 128
SPLIT_ALIGN = 64  # split_len is a multiple of this (a whole number of K/V tiles)
MIN_SPLIT_LEN = 256  # below this a split's fixed cost (q load, partial write, merge read) dominates
_DEFAULT_SM_COUNT = 132  # an sm_90 SXM part's SM count; used when planning for a CPU tensor
SPLIT_WAVES = 1  # target programs per SM of the default's fallback split (see default_split_len)
# The even split (default_split_len): two partial-kernel programs run on an SM at once, so splits that give every SM
# two evenly measured faster at the long-tail shapes than the rounded one-wave rule (docs/TREE_ATTENTION.md, "Split
# choice").
EVEN_PROGRAMS_PER_SM = 2
# Where a KV head has at most BALANCED_MAX_ROWS query rows (T <= 4 at G = 7), the even split takes at most
# sqrt(L) / SPLIT_LEN_SQRT_FACTOR splits: a program's serial work grows with its split's length and the merge's with
# the split count, so their sum is least near that count (measured best at L = 4k, 16k and 64k). Wider rows (a
# costlier program per split) measured faster with the even split only where its splits hold >= EVEN_MIN_SPLIT_LEN
# tokens, else one program per SM.
BALANCED_MAX_ROWS = 32
SPLIT_LEN_SQRT_FACTOR = 4
EVEN_MIN_SPLIT_LEN = 1024
# Over one-byte (fp8) caches, planned as such (``kv_dtype``), rows of at most BALANCED_MAX_ROWS take up to
# ONE_BYTE_SPLIT_FACTOR times the balanced splits, as short as ONE_BYTE_MIN_SPLIT_LEN: measured faster at B = 1-2
# (H200, against XQA fp8 too), where half the bytes per tile leave a split's widening and products, not its loads, as
# its serial chain (docs/TREE_ATTENTION.md, "Split choice").
ONE_BYTE_SPLIT_FACTOR = 2
ONE_BYTE_MIN_SPLIT_LEN = 128
# Longest split when the rows need several programs (T * G > 128): there more, shorter splits put more programs in
# flight, while for T * G <= 128 more splits only add partial traffic (docs/TREE_ATTENTION.md, "Split choice").
CHUNKED_MAX_SPLIT_LEN = 4096
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Backends that read half precision only (fp32 inputs go to triton, else torch, under "auto").
_HALF_ONLY = ("cuda",)
# Query rows per split counter of the plan: the smallest row tile of a kernel that counts split arrivals (Triton's 16),
# so every row chunk of any tile has its own counter.
SPLIT_COUNTER_ROWS = 16
# "auto" takes the CUDA backend over triton where a KV head has at least this many query rows (T * G) and the CUDA
# sm_90 context kernel runs the plan: measured 0.80-0.91x triton's time at 80-448 rows, mostly slower at 7-56 rows
# (H200 run of record, docs/TREE_ATTENTION.md; 57-79 rows unmeasured, left on triton).
AUTO_CUDA_MIN_ROWS = 80
# The kernel name "auto" gives that choice: the CUDA kernels, or triton for caches they refuse (_run_auto_cuda).
AUTO_CUDA = "cuda (auto)"
# Backends "auto" does not pick for fp8 caches (it picks triton, else torch) outside the rule below: the CUDA backend
# widens them in shared memory, measured 1.4-2.5x slower than triton's where its lockstep sm_90 or mma.sync kernels
# run. Explicitly, it runs. (v_scale costs every kernel the same: not a criterion.)
_FP8_NOT_AUTO = ("cuda",)
# ... except where its warp-specialized kernel runs the plan (T * G > 64), which measured faster than triton on every
# such case of the suite's H100 run of record (docs/TREE_ATTENTION.md, "fp8 caches", has the figures).


@dataclass
class TreeAttentionPlan:
    """Everything the kernels need besides q / k_cache / v_cache; built once per step, reused by every layer.

    Static ints: ``batch_size`` B, ``num_tree`` T, ``num_q_heads`` Hq, ``num_kv_heads`` Hkv,
    ``group`` G = Hq // Hkv, ``head_dim`` D, ``block_size`` (tokens per cache page), ``num_splits`` S
    (context splits per request, >= 1) and ``split_len`` (context tokens per split, a multiple of 64,
    ``S * split_len >= max context length``).

    Tensors (all on the device of the inputs, contiguous):

    * ``tree_mask int32 [B, T, ceil(T/32)]``: bit ``j % 32`` of word ``j // 32`` of row ``i`` is set iff
      node j is node i or an ancestor of i (padding rows / columns are 0).
    * ``context_lens int32 [B]``, ``num_nodes int32 [B]``, ``block_table int32 [B, max_blocks]``.
    * ``partial_out float32 [B, Hkv, S + 1, T * G, D]`` and ``partial_lse float32 [B, Hkv, S + 1, T * G]``:
      flash-decoding scratch. Slot ``s < S`` is context split s (tokens ``[s * split_len,
      min((s + 1) * split_len, context_lens[b]))``, unmasked), slot ``S`` is the tree part (the T tree
      tokens at slots ``context_lens[b] + j``, masked by ``tree_mask``). Row ``r = t * G + g`` is query
      head ``kv_head * G + g`` of node t. ``partial_lse`` is the natural-log log-sum-exp of the scaled
      scores, ``-inf`` for an empty split, whose ``partial_out`` is then undefined (a merge must not
      read it). A backend may use the scratch differently internally (the Triton backend folds the tree
      into the last non-empty context split and skips the scratch for single-split requests).
    * ``split_counters int32 [B, Hkv, >= ceil(T * G / SPLIT_COUNTER_ROWS)]``, zeros between runs: a backend that merges
      the splits in the last one to finish (Triton) counts each row chunk's arrivals there and resets them to 0 as it
      merges.
      None: such a backend merges in a second kernel.
    """

    batch_size: int
    num_tree: int
    num_q_heads: int
    num_kv_heads: int
    group: int
    head_dim: int
    block_size: int
    num_splits: int
    split_len: int
    tree_mask: torch.Tensor
    context_lens: torch.Tensor
    num_nodes: torch.Tensor
    block_table: torch.Tensor
    partial_out: torch.Tensor
    partial_lse: torch.Tensor
    split_counters: Optional[torch.Tensor] = None
    # Host-side facts about the block table, for run's page check (no sync there): the cache's page count the plan
    # was built for (None: not given), the largest page id the requests use as (value, request, column) (None: the
    # plan did not read the table), and whether run should read it once (validation was asked for but skipped
    # because a CUDA graph was being captured).
    num_blocks: Optional[int] = None
    max_page: Optional[Tuple[int, int, int]] = None
    check_pages_at_run: bool = False

    @property
    def device(self) -> torch.device:
        return self.tree_mask.device

    def run(self, q, k_cache, v_cache, out=None, sm_scale=None, backend: str = "auto", k_scale: float = 1.0,
            v_scale: float = 1.0) -> torch.Tensor:
        """See :func:`run`."""
        return run(self, q, k_cache, v_cache, out=out, sm_scale=sm_scale, backend=backend, k_scale=k_scale,
                   v_scale=v_scale)


def default_split_len(
    batch_size: int,
    num_kv_heads: int,
    max_context_len: int,
    sm_count: int = _DEFAULT_SM_COUNT,
    num_rows: int = 1,
    head_dim: int = 128,
    programs_per_sm: Optional[int] = None,
    kv_dtype: Optional[torch.dtype] = None,
) -> int:
    """Context tokens per split so that the partial kernel fills the GPU without needless splitting.

    A program owns one split of one KV head and up to ``R`` of the ``num_rows = T * G`` query rows
    (``R`` = 128, or 64 for ``head_dim`` 256: the kernels' largest row tile), so one split gives
    ``B * Hkv * ceil(num_rows / R)`` programs (``R`` = 64 when the rows need several programs). When
    they do, splits are at most ``CHUNKED_MAX_SPLIT_LEN`` tokens (measured). Every extra split writes and re-reads
    ``T * G * D`` fp32 partials per KV head (``2 * S * T * G / L`` of the K/V bytes). The rule:

    * at most ``BALANCED_MAX_ROWS`` rows: the most splits whose programs fit ``EVEN_PROGRAMS_PER_SM`` per SM, but
      at most ``sqrt(max_context_len) / SPLIT_LEN_SQRT_FACTOR`` (:func:`_balanced_splits`), lengths rounded up to
      whole tiles so every SM gets the same work; over one-byte caches (``kv_dtype`` fp8) up to
      ``ONE_BYTE_SPLIT_FACTOR`` times those splits, of at least ``ONE_BYTE_MIN_SPLIT_LEN`` tokens;
    * more rows in one program: the same without the cap, when those splits hold at least ``EVEN_MIN_SPLIT_LEN``
      tokens;
    * otherwise (and for chunked rows) about the fewest splits that reach ``SPLIT_WAVES * sm_count`` programs
      (lengths rounded down, so the count never falls short);

    otherwise never below ``MIN_SPLIT_LEN`` tokens a split. The result is a multiple of ``SPLIT_ALIGN`` (or of the
    CUDA sm_90 kernel's tile where it may run).
    ``programs_per_sm = k``: the even rule at ``k`` programs per SM whatever the split length (the tree-attention
    suite's ``one-wave`` and ``two-per-SM`` rows).
    """
    chunked, programs = _split_programs(batch_size, num_kv_heads, num_rows, head_dim)
    align = _split_align(num_rows, head_dim)
    if programs_per_sm is not None:
        if programs_per_sm < 1:
            raise ValueError(f"programs_per_sm must be >= 1 or None, got {programs_per_sm}")
        return _even_split_len(programs_per_sm, sm_count, programs, chunked, max_context_len, align)
    if num_rows <= BALANCED_MAX_ROWS:
        if _one_byte(kv_dtype):
            return _even_split_len(EVEN_PROGRAMS_PER_SM, sm_count, programs, chunked, max_context_len, align,
                                   most=ONE_BYTE_SPLIT_FACTOR * _balanced_splits(max_context_len),
                                   min_len=ONE_BYTE_MIN_SPLIT_LEN)
        return _even_split_len(EVEN_PROGRAMS_PER_SM, sm_count, programs, chunked, max_context_len, align,
                               most=_balanced_splits(max_context_len))
    if not chunked:
        even = _even_split_len(EVEN_PROGRAMS_PER_SM, sm_count, programs, chunked, max_context_len, align)
        if even >= EVEN_MIN_SPLIT_LEN:
            return even
    want = _clamp_splits(-(-SPLIT_WAVES * sm_count // programs), chunked, max_context_len)
    if want == 1:  # one split: its length only has to cover the context
        return _whole_tiles(max_context_len, align)
    # Round down to whole tiles so the split count stays >= want (MIN_SPLIT_LEN is whole tiles of either).
    return max(MIN_SPLIT_LEN, max_context_len // want // align * align)


def _split_programs(batch_size: int, num_kv_heads: int, num_rows: int, head_dim: int) -> Tuple[bool, int]:
    """``(chunked, programs per split)``: whether the rows need several programs, and how many programs a split has."""
    max_rows = 64 if head_dim > 128 else 128
    chunked = num_rows > max_rows
    rows_per_program = 64 if (chunked or head_dim > 128) else max_rows
    return chunked, max(1, batch_size * num_kv_heads * -(-max(num_rows, 1) // rows_per_program))


def _split_align(num_rows: int, head_dim: int) -> int:
    """Where the CUDA backend's sm_90 kernel may run (its auto rule's rows, D=128, caches of q's dtype or fp8 alike),
    splits are whole tiles of it. The glue module holds the rule's numbers; importing it does not load the
    extension."""
    from .._cuda import tree_attention as cuda_rule

    ctx_rows = num_rows >= cuda_rule.CONTEXT_SM90_MIN_ROWS and cuda_rule.context_rows_covered(num_rows)
    return cuda_rule.context_tile(num_rows) if head_dim == 128 and ctx_rows else SPLIT_ALIGN


def _one_byte(kv_dtype: Optional[torch.dtype]) -> bool:
    """Whether the plan is for caches of one byte per value (fp8); ``kv_dtype`` None: two-byte caches."""
    if kv_dtype is not None and not isinstance(kv_dtype, torch.dtype):
        raise TypeError(f"kv_dtype must be a torch.dtype or None, got {kv_dtype!r}")
    return kv_dtype is not None and kv_dtype.itemsize == 1


def _clamp_splits(want: int, chunked: bool, max_context_len: int, min_len: int = MIN_SPLIT_LEN) -> int:
    """``want`` splits, at least enough for ``CHUNKED_MAX_SPLIT_LEN`` when chunked, at most one per ``min_len``."""
    if chunked:
        want = max(want, -(-max_context_len // CHUNKED_MAX_SPLIT_LEN))
    return max(1, min(want, -(-max_context_len // min_len)))


def _even_split_len(per_sm: int, sm_count: int, programs: int, chunked: bool, max_context_len: int, align: int,
                    most: Optional[int] = None, min_len: int = MIN_SPLIT_LEN) -> int:
    """The most splits (up to ``most``) whose programs fit ``per_sm`` per SM, lengths rounded up to whole tiles (the
    count stays within the slots, and no split is a remainder shorter than the others by more than a tile), none
    shorter than ``min_len`` tokens."""
    want = max(1, per_sm * sm_count // programs)
    want = _clamp_splits(want if most is None else min(want, most), chunked, max_context_len, min_len)
    if want == 1:
        return _whole_tiles(max_context_len, align)
    per_split = -(-max_context_len // want)
    return max(min_len, _whole_tiles(per_split, align))


def _balanced_splits(max_context_len: int) -> int:
    """The most splits the default takes over a context of ``max_context_len`` tokens where a KV head has at most
    ``BALANCED_MAX_ROWS`` rows, ``isqrt(L) // SPLIT_LEN_SQRT_FACTOR`` (at least 1): 16 at L = 4096, 32 at 16384, 64
    at 65536. Each program walks its split's tiles one after another and the merge walks the splits one after
    another, so the serial chain is shortest where both are about sqrt(L) long."""
    return max(1, math.isqrt(max(0, max_context_len)) // SPLIT_LEN_SQRT_FACTOR)


def _whole_tiles(tokens: int, align: int) -> int:
    """``tokens`` rounded up to a multiple of ``align``, at least one tile."""
    return max(align, -(-tokens // align) * align)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _int32(t: torch.Tensor) -> torch.Tensor:
    return dense(saturate_to(t, torch.int32))


def _check_count(name: str, value, low: int, high: Optional[int] = None, *, optional: bool = False) -> None:
    """``value`` must be an int (not a bool) in ``[low, high]`` (or None when ``optional``): ValueError naming it."""
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        allowed = {0: "a non-negative int", 1: "a positive int"}[low] if high is None else f"an int in [{low}, {high}]"
        raise ValueError(f"{name} must be {allowed}{' (or None)' if optional else ''}, got {value!r}")


def _host_counts(name: str, value):
    """A per-request count given as a Python int or a list of them (tensors pass through): ints (not bools or floats,
    which int32 would truncate) within int32."""
    if value is None or isinstance(value, torch.Tensor):
        return value
    for v in [value] if isinstance(value, numbers.Number) else list(value):
        if not isinstance(v, numbers.Integral) or isinstance(v, bool) or not -(2**31) <= int(v) < 2**31:
            raise ValueError(f"{name} must hold int32 integers (a scalar, a list or an int32 [B] tensor), got {v!r}")
    return value


def _softmax_scale(sm_scale, head_dim: int) -> float:
    """``sm_scale`` as a float: a finite number >= 0 (the kernels track the running max on unscaled scores, which a
    negative scale would turn into the minimum), default ``1 / sqrt(head_dim)``."""
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    scale = math.nan
    one_number = not isinstance(sm_scale, (str, bytes, bool, torch.Tensor)) or (
        isinstance(sm_scale, torch.Tensor) and sm_scale.numel() == 1)
    if one_number:
        try:
            scale = float(sm_scale)
        except (TypeError, ValueError):
            pass
    if not (math.isfinite(scale) and scale >= 0):
        raise ValueError(f"sm_scale must be a finite number >= 0 (or None for 1/sqrt(head_dim)), got {sm_scale!r}")
    return scale


def _check_plan_args(num_q_heads, num_kv_heads, head_dim, block_size, max_context_len, split_len, num_blocks, validate):
    """The plan's scalar arguments, before any is used (a zero would otherwise divide)."""
    for name, v in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        _check_count(name, v, 1)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads} (GQA)")
    _check_count("block_size", block_size, 1, MAX_BLOCK_SIZE)
    _check_count("max_context_len", max_context_len, 0, optional=True)
    bad_split = not isinstance(split_len, int) or isinstance(split_len, bool) or split_len < 1 or split_len % SPLIT_ALIGN
    if split_len is not None and bad_split:
        raise ValueError(f"split_len must be a positive multiple of {SPLIT_ALIGN}, got {split_len!r}")
    _check_count("num_blocks", num_blocks, 0, optional=True)
    if not isinstance(validate, bool):
        raise ValueError(f"validate must be True or False, got {validate!r}")


def plan_tree_attention(
    parents: torch.Tensor,
    context_lens,
    block_table: torch.Tensor,
    num_nodes=None,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    max_context_len: Optional[int] = None,
    split_len: Optional[int] = None,
    num_blocks: Optional[int] = None,
    validate: bool = True,
    kv_dtype: Optional[torch.dtype] = None,
) -> TreeAttentionPlan:
    """Build the per-step plan of tree attention (shared by every layer).

    Args:
        parents: ``int32/int64 [B, T]`` tree of each request (:mod:`tlt_kernels.tree`), ``T <= 64`` for the kernels.
        context_lens: ``int32 [B]`` tokens in the cache before the tree (a scalar or list is accepted).
        block_table: ``int32 [B, max_blocks]`` page ids of each request.
        num_nodes: ``int32 [B]`` valid nodes per request (scalar / list accepted), default T.
        num_q_heads, num_kv_heads, head_dim, block_size: model / cache geometry (``Hq % Hkv == 0``).
        max_context_len: an upper bound of ``context_lens``; read from the tensor (one host sync) when None.
        split_len: context tokens per split (a multiple of 64); default :func:`default_split_len`.
        num_blocks: pages in the cache; when given, ``validate`` also checks every used table entry is below it, and
            ``run`` checks the caches have exactly that many pages.
        validate: check values (host sync). Skipped during CUDA-graph capture.
        kv_dtype: the caches' dtype, where known: the default split takes more, shorter splits over fp8 caches at
            small batch. Only the split depends on it: a plan runs over caches of any dtype ``run`` accepts.

    Views (any strides) are accepted: the tensors the kernels read are copied to contiguous ones when they are not.
    Validation reads the table once; ``run`` then checks its pages against the caches it gets with no further sync.

    Returns:
        A :class:`TreeAttentionPlan`; only ``tree_mask`` and the scratch are freshly allocated.
    """
    _check_plan_args(num_q_heads, num_kv_heads, head_dim, block_size, max_context_len, split_len, num_blocks, validate)
    _one_byte(kv_dtype)  # a TypeError naming kv_dtype before any work
    parents, context_lens, block_table, num_nodes = _plan_tables(parents, context_lens, block_table, num_nodes)
    capturing = _capturing()
    checked = validate and not capturing
    max_page = None
    if checked:
        max_page = _validate_plan(parents, context_lens, num_nodes, block_table, block_size, num_blocks)
    return _make_plan(dense(tree_ancestor_mask_packed(parents, num_nodes)), context_lens, block_table, num_nodes,
                      num_q_heads, num_kv_heads, head_dim, block_size, max_context_len, split_len, num_blocks,
                      max_page=max_page, check_pages_at_run=validate and capturing, checked=checked, kv_dtype=kv_dtype)


def plan_masked_attention(
    mask: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    max_context_len: int,
    num_blocks: Optional[int] = None,
    kv_dtype: Optional[torch.dtype] = None,
    num_nodes: Optional[torch.Tensor] = None,
    split_counters: Optional[torch.Tensor] = None,
) -> TreeAttentionPlan:
    """A plan whose ``T`` new tokens see each other through an explicit mask instead of a tree's ancestors.

    For visibility patterns that no single ``parents`` row describes: the forest of nodes a drafter has expanded so far
    (several roots), or a causal chunk of new tokens. Token ``j`` of request ``b`` is at slot ``context_lens[b] + j``
    and every token sees the whole context, as in :func:`plan_tree_attention`. No value checks and no host sync
    (CUDA-graph capturable): the caller guarantees the table covers ``context_lens + T`` slots.

    Args:
        mask: ``bool [B, T, T]``; ``mask[b, i, j]``: token i sees token j. Every row sees the whole context as well;
            give each row at least itself, so that no row sees nothing (an empty context and an empty row). Or the
            same mask bit-packed, ``int32 [B, T, ceil(T / 32)]`` (:func:`tlt_kernels.pack_tree_mask`'s layout).
        context_lens: ``int32 [B]``; block_table: ``int32 [B, max_blocks]``.
        num_q_heads, num_kv_heads, head_dim, block_size: model / cache geometry.
        max_context_len: an upper bound of ``context_lens`` (the table's capacity will do): sizes the context split.
        num_blocks: pages in the cache (``run`` checks the caches against it).
        kv_dtype: the caches' dtype, where known (sizes the split, as in :func:`plan_tree_attention`).
        num_nodes: ``int32 [B]``, ``T`` for every request, when the caller keeps one (a launch fewer per plan); its
            values are not checked. None: made here.
        split_counters: ``int32 [B, num_kv_heads, C]`` zeros with ``C >= ceil(T * G / SPLIT_COUNTER_ROWS)``,
            contiguous, to share with other plans run one after another on one stream (every run leaves them zeros),
            such as one draft's plans, each a few nodes wider: one zeroing for them all. None: fresh zeros.
    """
    check_tensor("mask", mask, dtype=(torch.bool, torch.int32), ndim=3)
    B, T, cols = mask.shape
    words = (T + 31) // 32
    if T < 1 or cols != (T if mask.dtype == torch.bool else words):
        raise ValueError(f"mask must be bool [B, T, T] or bit-packed int32 [B, T, ceil(T / 32)] with T >= 1, got "
                         f"{mask.dtype} of shape {tuple(mask.shape)}")
    check_tensor("context_lens", context_lens, dtype=torch.int32, shape=(B,), device=mask.device)
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=mask.device)
    _check_plan_args(num_q_heads, num_kv_heads, head_dim, block_size, max_context_len, None, num_blocks, False)
    _one_byte(kv_dtype)
    # Every row is a node: the mask alone says what each sees.
    if num_nodes is None:
        num_nodes = torch.full((B,), T, dtype=torch.int32, device=mask.device)
    check_tensor("num_nodes", num_nodes, dtype=torch.int32, shape=(B,), device=mask.device)
    if split_counters is not None:
        _check_shared_counters(split_counters, B, num_kv_heads, T * (num_q_heads // num_kv_heads), mask.device)
    packed = pack_tree_mask(mask) if mask.dtype == torch.bool else mask
    return _make_plan(dense(packed), dense(context_lens), dense(block_table), dense(num_nodes), num_q_heads,
                      num_kv_heads, head_dim, block_size, max_context_len, None, num_blocks, max_page=None,
                      check_pages_at_run=False, checked=False, kv_dtype=kv_dtype, split_counters=split_counters)


def _check_shared_counters(counters: torch.Tensor, B: int, num_kv_heads: int, rows: int, device) -> None:
    check_tensor("split_counters", counters, dtype=torch.int32, ndim=3, device=device)
    need = -(-rows // SPLIT_COUNTER_ROWS)
    if tuple(counters.shape[:2]) != (B, num_kv_heads) or counters.shape[2] < need or not counters.is_contiguous():
        raise ValueError(f"split_counters must be contiguous int32 [B={B}, num_kv_heads={num_kv_heads}, >= {need}], "
                         f"got shape {tuple(counters.shape)} with strides {counters.stride()}")


def _make_plan(tree_mask, context_lens, block_table, num_nodes, num_q_heads, num_kv_heads, head_dim, block_size,
               max_context_len, split_len, num_blocks, *, max_page, check_pages_at_run, checked,
               kv_dtype=None, split_counters=None) -> TreeAttentionPlan:
    """The plan around a packed mask ``int32 [B, T, ceil(T/32)]``: the context split and the fp32 scratch (and
    fresh zeroed ``split_counters`` unless given)."""
    B, T = tree_mask.shape[:2]
    G = num_q_heads // num_kv_heads
    num_splits, split_len = _context_split(context_lens, block_table.shape[1] * block_size, max_context_len, split_len,
                                           num_kv_heads, T * G, head_dim, capturing=_capturing(), checked=checked,
                                           kv_dtype=kv_dtype)
    M = T * G
    dev = tree_mask.device
    return TreeAttentionPlan(
        batch_size=B, num_tree=T, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, group=G, head_dim=head_dim,
        block_size=block_size, num_splits=num_splits, split_len=split_len, tree_mask=tree_mask,
        context_lens=context_lens, num_nodes=num_nodes, block_table=block_table,
        partial_out=torch.empty(B, num_kv_heads, num_splits + 1, M, head_dim, dtype=torch.float32, device=dev),
        partial_lse=torch.empty(B, num_kv_heads, num_splits + 1, M, dtype=torch.float32, device=dev),
        split_counters=split_counters if split_counters is not None
        else torch.zeros(B, num_kv_heads, -(-M // SPLIT_COUNTER_ROWS), dtype=torch.int32, device=dev),
        num_blocks=num_blocks, max_page=max_page, check_pages_at_run=check_pages_at_run,
    )


def _plan_tables(parents, context_lens, block_table, num_nodes):
    """The plan's per-request tables, checked (shapes, dtypes, devices, and the values of scalars and lists, which
    become ``[B]`` tensors; nothing is read back from the device) and made dense: ``(parents [B, T], context_lens
    int32 [B], block_table int32 [B, max_blocks], num_nodes int32 [B])``."""
    check_tensor("parents", parents, dtype=(torch.int32, torch.int64), ndim=2)
    parents = dense(parents)
    B, T = parents.shape
    dev = parents.device
    if T < 1:
        raise ValueError("parents must hold at least one node (the root) per request, got T=0")
    context_lens = _int32(per_request("context_lens", _host_counts("context_lens", context_lens), B, dev, torch.int32))
    num_nodes = per_request("num_nodes", _host_counts("num_nodes", num_nodes), B, dev, torch.int32)
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=dev)
    if block_table.shape[0] != B:
        raise ValueError(f"block_table has {block_table.shape[0]} rows, expected one per request (B={B})")
    block_table = _int32(block_table)
    num_nodes = dense(resolve_num_nodes(parents, num_nodes))  # int32, saturated
    return parents, context_lens, block_table, num_nodes


def _validate_plan(parents, context_lens, num_nodes, block_table, block_size, num_blocks) -> Tuple[int, int, int]:
    """The value checks of ``validate=True`` (host sync): the trees, then the tables. Returns the largest used page
    (see :func:`_validate_tables`)."""
    try:
        validate_tree(parents, num_nodes)
    except ValueError as exc:
        raise ValueError(f"parents: {exc}") from None
    return _validate_tables(context_lens, num_nodes, block_table, block_size, num_blocks)


def _sm_count_of(device: torch.device) -> int:
    """The SM count the default split is sized for: the GPU's, or an sm_90 SXM part's for a CPU tensor."""
    if device.type != "cuda":
        return _DEFAULT_SM_COUNT
    return cuda_sm_count(device)


def _context_split(context_lens, table_capacity: int, max_context_len, split_len, num_kv_heads: int, num_rows: int,
                   head_dim: int, *, capturing: bool, checked: bool, kv_dtype=None) -> Tuple[int, int]:
    """``(num_splits, split_len)`` of the flash-decoding split: ``split_len`` given or :func:`default_split_len`, and
    enough splits to cover ``max_context_len`` (when None: the longest of ``context_lens``, one sync, or the table's
    capacity during capture). When ``checked``, a given ``max_context_len`` that the lengths exceed raises."""
    B = context_lens.shape[0]
    if max_context_len is None:
        # Reading the lengths would sync; during capture the table's capacity is a safe upper bound.
        max_context_len = table_capacity if capturing else (int(context_lens.max()) if B else 0)
    if split_len is None:
        split_len = default_split_len(B, num_kv_heads, max_context_len, _sm_count_of(context_lens.device), num_rows,
                                      head_dim, kv_dtype=kv_dtype)
    num_splits = max(1, -(-max_context_len // split_len))
    if checked:
        longest = int(context_lens.max()) if B else 0
        if longest > num_splits * split_len:
            raise ValueError(f"context_lens reaches {longest} but max_context_len={max_context_len} was given (must be an upper bound)")
    return num_splits, split_len


def _validate_tables(context_lens, num_nodes, block_table, block_size, num_blocks) -> Tuple[int, int, int]:
    """Value checks of the per-request tables (host sync). Returns the largest page id the requests use, as
    ``(value, request, column)`` (``(-1, -1, -1)`` when none is used), for run's check against the caches."""
    ctx = context_lens.cpu().long()
    n = num_nodes.cpu().long()
    table = block_table.cpu().long()
    max_blocks = table.shape[1]
    bad = (ctx < 0).nonzero()
    if bad.numel():
        b = int(bad[0, 0])
        raise ValueError(f"context_lens[{b}] = {int(ctx[b])} is negative")
    used = ctx + n
    capacity = max_blocks * block_size
    over = (used > capacity).nonzero()
    if over.numel():
        b = int(over[0, 0])
        raise ValueError(
            f"request {b}: context_lens + num_nodes = {int(used[b])} exceeds the block table's capacity "
            f"max_blocks * block_size = {max_blocks} * {block_size} = {capacity}"
        )
    pages_used = -(-used // block_size)  # [B]
    in_use = torch.arange(max_blocks)[None, :] < pages_used[:, None]
    bad_entry = table < 0
    if num_blocks is not None:
        bad_entry |= table >= num_blocks
    out_of_range = in_use & bad_entry
    if out_of_range.any():
        b, i = (int(v) for v in out_of_range.nonzero()[0])
        raise ValueError(_page_error(b, i, int(table[b, i]), int(pages_used[b]), num_blocks))
    return _largest_used_page(table, in_use)


def _largest_used_page(table: torch.Tensor, in_use: torch.Tensor) -> Tuple[int, int, int]:
    """``(value, request, column)`` of the largest used entry of a host table (``(-1, -1, -1)`` when none is used)."""
    used_values = torch.where(in_use, table, -1)
    if not used_values.numel():
        return -1, -1, -1
    flat = int(used_values.argmax())
    b, i = divmod(flat, table.shape[1])
    return int(used_values[b, i]), b, i


def _page_error(b: int, i: int, value: int, pages: Optional[int], num_blocks: Optional[int]) -> str:
    """The message for a used block-table entry out of range: the argument, request, entry, value and allowed range."""
    bound = f"[0, num_blocks={num_blocks})" if num_blocks is not None else ">= 0"
    spans = f" spans {pages} pages" if pages is not None else " uses it"
    return f"block_table[{b}, {i}] = {value} is used (request {b}{spans}) but not in {bound}"


def _cache_dtypes(q_dtype: torch.dtype):
    """The cache dtypes a query dtype reads: its own, and the fp8 formats for bf16/fp16 queries."""
    return q_dtype if q_dtype == torch.float32 else (q_dtype, *FP8_DTYPES)


def _check_run_inputs(plan: TreeAttentionPlan, q, k_cache, v_cache, out) -> None:
    """Shape / dtype / device / layout checks against the plan (metadata only: safe during capture)."""
    B, T, Hq, Hkv, D = plan.batch_size, plan.num_tree, plan.num_q_heads, plan.num_kv_heads, plan.head_dim
    dev = plan.device
    check_tensor("q", q, dtype=_FLOAT_DTYPES, shape=(B, T, Hq, D), device=dev)
    check_tensor("k_cache", k_cache, dtype=_cache_dtypes(q.dtype), shape=(None, plan.block_size, Hkv, D), device=dev)
    check_tensor("v_cache", v_cache, dtype=k_cache.dtype, shape=tuple(k_cache.shape), device=dev)
    if out is not None:
        check_tensor("out", out, dtype=q.dtype, shape=(B, T, Hq, D), device=dev)
        if _overlaps_itself(out):
            raise ValueError(f"out has elements sharing memory (shape {tuple(out.shape)}, strides {out.stride()}, an "
                             "expanded view?): every output element needs its own memory")
    # The caches are read in place (any strides but a contiguous head dim): copying them per layer would cost more
    # than the attention. out is written in place the same way.
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t is not None and t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along head_dim (stride(-1) == 1), got strides {t.stride()}")


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory: the dims of size > 1, sorted by stride, must each step past
    the whole extent of the smaller ones (true of any view made by slicing, permuting or narrowing)."""
    extent = 1
    for stride, size in sorted((t.stride(d), t.shape[d]) for d in range(t.dim()) if t.shape[d] > 1):
        if stride < extent:
            return True
        extent = stride * (size - 1) + extent
    return False


def _check_pages(plan: TreeAttentionPlan, k_cache: torch.Tensor) -> None:
    """Used block-table entries against the caches' page count, on the host: from the plan's record of the table (no
    sync), or, when validation was skipped under capture, by reading the table once at the first run outside capture.
    A table nobody read (validate=False, or every run captured) is checked by the kernels: an out-of-range page is
    never read and its request's rows come out NaN."""
    num_blocks = k_cache.shape[0]
    if plan.num_blocks is not None and num_blocks != plan.num_blocks:
        raise ValueError(f"k_cache has {num_blocks} blocks but the plan was built with num_blocks={plan.num_blocks}")
    if plan.batch_size and num_blocks == 0:
        raise ValueError("k_cache has no blocks (shape[0] == 0) but every request needs at least one page")
    if plan.max_page is None and plan.check_pages_at_run and not _capturing() and not torch.compiler.is_compiling():
        ctx, n = plan.context_lens.cpu().long(), plan.num_nodes.cpu().long()
        table = plan.block_table.cpu().long()
        in_use = torch.arange(table.shape[1])[None, :] < (-(-(ctx + n) // plan.block_size))[:, None]
        negative = (in_use & (table < 0)).nonzero()
        if negative.numel():
            b, i = (int(v) for v in negative[0])
            raise ValueError(_page_error(b, i, int(table[b, i]), None, num_blocks))
        plan.max_page = _largest_used_page(table, in_use)
    if plan.max_page is not None and plan.max_page[0] >= num_blocks:
        value, b, i = plan.max_page
        raise ValueError(_page_error(b, i, value, None, num_blocks) + " (k_cache.shape[0])")


def _kernel_limits(num_tree: int, head_dim: int) -> Optional[str]:
    if head_dim not in KERNEL_HEAD_DIMS:
        return f"head_dim={head_dim} is not one of {KERNEL_HEAD_DIMS}"
    if num_tree > KERNEL_MAX_NODES:
        return f"T={num_tree} tree nodes exceeds the kernels' limit of {KERNEL_MAX_NODES}"
    return None


def _assume_constant_result(fn):
    """``torch.compiler.assume_constant_result`` without importing torch._dynamo (and Triton) at our import.

    The public decorator only imports dynamo and sets this marker; doing the same here keeps
    ``import tlt_kernels`` light. tests/ops/test_tree_attention.py compiles the op with fullgraph=True on the
    GPU, which fails loudly if a torch release ever changes the marker.
    """
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def _choose_backend(backend: str, device: torch.device, num_tree: int, head_dim: int, fp32: bool = False,
                    fp8: bool = False, plan_sizes: Optional[Tuple[int, int, int]] = None) -> str:
    """The kernel to run (decided once at trace time under torch.compile, so no graph break): a backend's name, or
    ``AUTO_CUDA``. ``plan_sizes``: ``(group, block_size, split_len)``, for "auto"'s ``AUTO_CUDA_MIN_ROWS`` rule."""
    name = _BACKENDS.choose(backend, device)
    if fp32 and name in _HALF_ONLY and backend != "auto":
        raise ValueError(f"tree_attention backend {name!r} reads bf16/fp16; fp32 inputs run on 'triton' or 'torch'")
    if backend == "auto" and ((fp32 and name in _HALF_ONLY) or (fp8 and name in _FP8_NOT_AUTO)):
        name = "triton" if backend_unavailable_reason("triton", device) is None else "torch"
    if backend == "auto" and name == "triton" and not fp32 and plan_sizes is not None:
        name = AUTO_CUDA if _auto_takes_cuda(device, num_tree, head_dim, *plan_sizes, fp8=fp8) else name
    if name != "torch":
        why = _kernel_limits(num_tree, head_dim)
        if why is not None:
            if backend != "auto":
                raise ValueError(f"tree_attention backend {name!r}: {why}; use backend='torch' or 'auto'")
            warnings.warn(f"tree_attention: {why}; falling back to the (slow) torch path", stacklevel=3)
            name = "torch"
    return name


def _auto_takes_cuda(device: torch.device, num_tree: int, head_dim: int, group: int, block_size: int,
                     split_len: int, fp8: bool = False) -> bool:
    """Whether "auto" runs bf16/fp16 q on the CUDA backend rather than triton: caches of q's dtype at
    ``T * G >= AUTO_CUDA_MIN_ROWS``, fp8 caches where the warp-specialized kernel takes the rows (see
    ``_FP8_NOT_AUTO``); in both, only where the sm_90 context kernel runs the plan."""
    if backend_unavailable_reason("cuda", device) is not None:
        return False
    from .._cuda import tree_attention as cuda_rule

    rows = num_tree * group
    if fp8:
        if not cuda_rule.takes_warp_specialized(rows, fp8=True):
            return False
    elif rows < AUTO_CUDA_MIN_ROWS:
        return False
    return cuda_rule.context_kernel_takes(num_tree, group, head_dim, block_size, split_len, device, fp8)


def _run_auto_cuda(plan, q, k_cache, v_cache, out, sm_scale, v_scale):
    """"auto"'s CUDA choice: the CUDA kernels, or triton where they refuse the caches (rows not 16-byte aligned)."""
    from .._cuda import tree_attention as cuda_glue

    name = "cuda" if cuda_glue.unsupported_reason(plan, q, k_cache, v_cache) is None else "triton"
    return _BACKENDS.get(name)(plan, q, k_cache, v_cache, out, sm_scale, v_scale)


def _kernel(name: str):
    """The function running kernel ``name`` (a backend, or ``AUTO_CUDA``)."""
    return _run_auto_cuda if name == AUTO_CUDA else _BACKENDS.get(name)


def run(plan: TreeAttentionPlan, q, k_cache, v_cache, out=None, sm_scale=None, backend: str = "auto",
        k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Tree attention of one layer with a prebuilt plan. No host synchronization (but one table read at the first run
    outside capture of a plan whose validation a capture skipped).

    NaN: a NaN in the K or V of a slot a row attends (its request's context, its tree ancestors and itself, in its KV
    head) makes that output row NaN-bearing, as plain attention would; slots no row attends (past ``context_lens``,
    padding nodes' slots, other requests' pages, non-ancestors' tree slots) never reach the output, whatever they hold.
    A block-table entry out of ``[0, k_cache.shape[0])`` among the pages a request uses raises a ValueError when the
    host knows the table (see :func:`plan_tree_attention`); otherwise the kernels never read it and the request's
    rows come out NaN.

    Args:
        plan: from :func:`plan_tree_attention`.
        q: ``[B, T, Hq, D]`` bf16/fp16 queries of the tree nodes (fp32 too: triton or torch; the CUDA kernel is half precision).
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, q's dtype, or both fp8 (``float8_e4m3fn`` /
            ``float8_e5m2``) with bf16/fp16 q; node i's K/V already at slot ``context_lens[b] + i``.
        out: optional ``[B, T, Hq, D]`` output buffer of q's dtype, written in place (any strides with a
            contiguous head dim; a view whose elements share memory is refused).
        sm_scale: a finite number >= 0, default ``1 / sqrt(D)``.
        backend: ``"auto"``, ``"torch"``, ``"triton"`` or ``"cuda"``. ``"auto"`` takes triton, and the CUDA
            backend on sm_90 where a KV head has ``T * G >= AUTO_CUDA_MIN_ROWS`` query rows and its sm_90 kernel
            runs the plan (D = 128, bf16/fp16, power-of-two pages); over fp8 caches only where ``T * G > 64``
            (its warp-specialized kernel). Shapes the kernels do not cover
            (``T > 64`` or ``D`` not in 64/128/256) fall back to torch with a warning under ``"auto"``
            and raise for an explicit kernel backend.
        k_scale, v_scale: per-tensor dequantization scales, finite numbers > 0: the caches hold ``K / k_scale`` and
            ``V / v_scale`` (an fp8 cache's usual scales; any cache dtype). ``k_scale`` folds into the softmax scale,
            ``v_scale`` into each output row. ``"auto"`` runs fp8 caches on triton (torch without it), or on the
            CUDA backend's warp-specialized kernel (above); ``"cuda"`` runs them on its sm_90 kernels where they
            take the plan (D = 128: the warp-specialized one at ``T * G > 64``, the lockstep ones at fewer rows),
            else on its mma.sync kernel.

    Returns:
        ``out`` with rows at or past ``num_nodes[b]`` set to zero.
    """
    _check_run_inputs(plan, q, k_cache, v_cache, out)
    _check_pages(plan, k_cache)
    # The kernels honour q's strides but need a contiguous head dim; q is small, so any other view is copied.
    q = q if q.stride(-1) == 1 else dense(q)
    scale = _softmax_scale(sm_scale, plan.head_dim) * _dequant_scale("k_scale", k_scale)
    v_scale = _dequant_scale("v_scale", v_scale)
    fp8 = k_cache.dtype in FP8_DTYPES
    name = _choose_backend(backend, q.device, plan.num_tree, plan.head_dim, q.dtype == torch.float32, fp8,
                           (plan.group, plan.block_size, plan.split_len))
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if name == "torch":
        return run_torch(plan, q, k_cache, v_cache, out, scale, v_scale)
    if direct_dispatch_ok(q, k_cache, v_cache, out, plan.block_table, plan.context_lens, plan.num_nodes, plan.tree_mask,
                          plan.partial_out, plan.partial_lse, plan.split_counters):
        # Plain eager: the kernel directly, without the mutating op's dispatch (host time per layer).
        _kernel(name)(plan, q, k_cache, v_cache, out, scale, v_scale)
        return out
    torch.ops.tlt.tree_attention_run(
        q, k_cache, v_cache, plan.block_table, plan.context_lens, plan.num_nodes, plan.tree_mask,
        plan.partial_out, plan.partial_lse, _counters_of(plan), out, scale, v_scale, plan.split_len, name,
    )
    return out


def _dequant_scale(name: str, value) -> float:
    """A cache's dequantization scale as a float: a finite real number > 0 (bools and tensors refused: a scale read
    from a device tensor would be a host sync per layer)."""
    if type(value) is float and 0.0 < value < math.inf:  # the common case, without the numbers ABC checks
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (0.0 < float(value) < math.inf):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _counters_of(plan: TreeAttentionPlan) -> torch.Tensor:
    """The plan's split counters for the op, whose schema has no optional tensors: an empty tensor for None."""
    if plan.split_counters is not None:
        return plan.split_counters
    return torch.empty(0, dtype=torch.int32, device=plan.partial_lse.device)


@torch.library.custom_op("tlt::tree_attention_run", mutates_args=("partial_out", "partial_lse", "split_counters", "out"))
def _tree_attention_run_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    num_nodes: torch.Tensor,
    tree_mask: torch.Tensor,
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    split_counters: torch.Tensor,
    out: torch.Tensor,
    sm_scale: float,
    v_scale: float,
    split_len: int,
    backend: str,
) -> None:
    """Kernel backends behind one opaque op, so torch.compile neither traces nor breaks on them."""
    B, T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    plan = TreeAttentionPlan(
        batch_size=B, num_tree=T, num_q_heads=Hq, num_kv_heads=Hkv, group=Hq // Hkv, head_dim=D,
        block_size=k_cache.shape[1], num_splits=partial_out.shape[2] - 1, split_len=split_len,
        tree_mask=tree_mask, context_lens=context_lens, num_nodes=num_nodes, block_table=block_table,
        partial_out=partial_out, partial_lse=partial_lse, split_counters=split_counters,
    )
    _kernel(backend)(plan, q, k_cache, v_cache, out, sm_scale, v_scale)


@_tree_attention_run_op.register_fake
def _(q, k_cache, v_cache, block_table, context_lens, num_nodes, tree_mask, partial_out, partial_lse, split_counters,
      out, sm_scale, v_scale, split_len, backend):
    return None


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens,
    parents: torch.Tensor,
    num_nodes=None,
    sm_scale: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
    backend: str = "auto",
    validate: bool = True,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of draft-tree nodes over their request's paged context and their tree ancestors.

    Node i of request b attends to the ``context_lens[b]`` context tokens and to the tree tokens of
    its ancestors and itself (slots ``context_lens[b] + j``, whose K/V the caller already wrote).

    Args:
        q: ``[B, T, Hq, D]`` bf16/fp16 (fp32 too: triton or torch; the CUDA kernel is half precision).
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` of q's dtype (or both fp8 with bf16/fp16 q, read as
            value * scale), ``Hq % Hkv == 0``, block_size <= 128.
        block_table: ``int32 [B, max_blocks]``; context_lens: ``int32 [B]``.
        parents: ``int32 [B, T]`` tree (``parents[b, 0] == -1``, ``0 <= parents[b, i] < i``).
        num_nodes: ``int32 [B]`` valid nodes per request, default T.
        sm_scale: default ``1 / sqrt(D)``.
        out: optional ``[B, T, Hq, D]`` buffer.
        backend: ``"auto"`` | ``"torch"`` | ``"triton"`` | ``"cuda"``.
        validate: check the tree and table values (host sync; skipped during CUDA-graph capture).
        k_scale, v_scale: the caches' dequantization scales (see :func:`run`).

    Returns:
        ``[B, T, Hq, D]`` of q's dtype; rows at or past ``num_nodes[b]`` are zeros.

    Builds a plan and runs it once; to run many layers on one tree, use :func:`plan_tree_attention`.
    """
    check_tensor("q", q, dtype=_FLOAT_DTYPES, ndim=4)
    B, T, Hq, D = q.shape
    dev = q.device
    check_tensor("k_cache", k_cache, dtype=_cache_dtypes(q.dtype), ndim=4, device=dev)
    check_tensor("v_cache", v_cache, dtype=k_cache.dtype, shape=tuple(k_cache.shape), device=dev)
    num_blocks, block_size, Hkv, Dk = k_cache.shape
    if Dk != D:
        raise ValueError(f"k_cache head_dim {Dk} != q head_dim {D}")
    check_tensor("parents", parents, dtype=(torch.int32, torch.int64), shape=(B, T), device=dev)
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=dev)
    if isinstance(context_lens, torch.Tensor):
        check_tensor("context_lens", context_lens, dtype=torch.int32, shape=(B,), device=dev)
    if isinstance(num_nodes, torch.Tensor):
        check_tensor("num_nodes", num_nodes, dtype=torch.int32, shape=(B,), device=dev)
    plan = plan_tree_attention(
        parents, context_lens, block_table, num_nodes,
        num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, block_size=block_size,
        num_blocks=num_blocks, validate=validate, kv_dtype=k_cache.dtype,
    )
    return run(plan, q, k_cache, v_cache, out=out, sm_scale=sm_scale, backend=backend, k_scale=k_scale,
               v_scale=v_scale)
