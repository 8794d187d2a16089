"""philox_uniform: every backend bit for bit against the reference (extreme words, broadcasting, empty and scalar
shapes; the reference's known-answer vectors are in tests/test_package.py), the coins a walk draws, validation
naming the argument, torch.compile, CUDA-graph capture, and a hypothesis property."""
import pytest
import torch
from conftest import agreement_backends, kernel_devices, need_backend
from hypothesis import given
from hypothesis import strategies as st
from strategies import assert_rejects, backend_params, budget

import tlt_kernels
from tlt_kernels import philox_uniform
from tlt_kernels.ops.philox_uniform import _PHILOX_UNIFORM
from tlt_kernels.rng import PURPOSE_ACCEPT, PURPOSE_SAMPLE, uniform

DEVICE = torch.device(kernel_devices()[0])
SEEDS = [0, 1, -1, 2**32 + 7, 2**40 + 3, -(2**63), 2**63 - 1, 12345678901, -987654321]
OFFSETS = [0, 5, 2**32, 2**33 + 1, -1, 7, 2**62, 3, 1]
NODES = [0, 1, 2, 63, 64, 1000, 2**20, 2**31 - 1, 2**32 - 1]


@pytest.mark.parametrize("backend", agreement_backends())
@pytest.mark.parametrize("purpose", [PURPOSE_ACCEPT, PURPOSE_SAMPLE, 12345])
def test_matches_reference_bit_for_bit(backend, purpose):
    """Extreme 64-bit words (ints and tensors), nodes up to 2**32 - 1: the reference's bits, inside (0, 1)."""
    need_backend("philox_uniform", backend, DEVICE)
    seeds, offsets, nodes = (torch.tensor(v, dtype=torch.int64) for v in (SEEDS, OFFSETS, NODES))
    got = philox_uniform(seeds.to(DEVICE), offsets.to(DEVICE), nodes.to(DEVICE), purpose, backend=backend)
    want = uniform(seeds, offsets, nodes, purpose)
    assert got.dtype == torch.float32 and got.device.type == DEVICE.type
    assert torch.equal(got.cpu(), want) and bool(((got > 0) & (got < 1)).all())


@pytest.mark.parametrize("backend", agreement_backends())
def test_broadcasting_and_shapes(backend):
    """Per-request seeds against per-node positions broadcast to ``[B, n]``; ints are filled on the tensors' device;
    empty and 0-d shapes come back as such."""
    need_backend("philox_uniform", backend, DEVICE)
    seeds = torch.tensor(SEEDS[:4], dtype=torch.int64, device=DEVICE).unsqueeze(1)
    nodes = torch.arange(1, 8, dtype=torch.int32, device=DEVICE)
    got = philox_uniform(seeds, 3, nodes, PURPOSE_ACCEPT, backend=backend)
    assert got.shape == (4, 7)
    assert torch.equal(got.cpu(), uniform(seeds.cpu(), torch.tensor(3), nodes.cpu().long(), PURPOSE_ACCEPT))
    empty = philox_uniform(seeds[:0], 0, nodes, PURPOSE_ACCEPT, backend=backend)
    assert empty.shape == (0, 7) and empty.device.type == DEVICE.type
    scalar = philox_uniform(torch.tensor(5, device=DEVICE), 1, 2, PURPOSE_SAMPLE, backend=backend)
    assert scalar.shape == () and float(scalar) == float(uniform(torch.tensor(5), 1, 2, PURPOSE_SAMPLE))


def test_the_walk_draws_these_coins():
    """The coin verify_tree's walk tests its first draft against is ``philox_uniform(seed, offset, 1, ACCEPT)``: a
    draft whose target probability sits just above (below) that coin is accepted (rejected)."""
    seed, offset = 77, 5
    coin = float(philox_uniform(seed, offset, 1, PURPOSE_ACCEPT))
    for p, accepted in ((min(coin * 1.001, 1.0), 1), (coin * 0.999, 0)):
        logits = torch.full((1, 2, 2), float("-inf"))
        logits[0, 0] = torch.tensor([p, 1 - p]).log()  # root row: token 0 with probability p
        logits[0, 1, 0] = 0.0
        result = tlt_kernels.verify_tree(logits, torch.tensor([[0, 0]]), torch.tensor([[-1, 0]], dtype=torch.int32),
                                         temperature=1.0, seed=seed, offset=offset, backend="torch")
        assert int(result.num_accepted[0]) == accepted


def test_auto_is_the_reference_on_cpu():
    assert _PHILOX_UNIFORM.choose("auto", torch.device("cpu")) == "torch"


def test_bad_inputs():
    t = torch.arange(3)
    for name, args in [("seed", (t.float(), 0, 0, 0)), ("offset", (0, [1], 0, 0)), ("node", (0, 0, True, 0)),
                       ("purpose", (0, 0, 0, -1)), ("purpose", (0, 0, 0, 2**31)), ("purpose", (0, 0, 0, 1.0)),
                       ("offset", (t, t.to("meta"), 0, 0))]:
        assert_rejects(philox_uniform, name, *args, backend="torch")
    assert_rejects(philox_uniform, "backend", t, 0, 0, 0, backend="tpu")
    with pytest.raises(tlt_kernels.BackendUnavailableError, match="philox_uniform has no 'cuda' backend"):
        philox_uniform(t, 0, 0, 0, backend="cuda")


@pytest.mark.parametrize("backend", backend_params())
def test_torch_compile(backend):
    seeds, nodes = torch.tensor(SEEDS, dtype=torch.int64), torch.tensor(NODES, dtype=torch.int64)

    def fn(seeds, nodes):
        return philox_uniform(seeds, 9, nodes + 0, PURPOSE_SAMPLE, backend=backend)

    torch._dynamo.reset()
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(seeds, nodes)
    assert torch.equal(got, fn(seeds, nodes))


@pytest.mark.cuda
def test_cuda_graph_replays_with_new_offsets():
    """Captured once, the launch reads seeds and offsets from device tensors: replays follow the values in place."""
    seeds = torch.tensor(SEEDS, dtype=torch.int64, device="cuda")
    offsets = torch.zeros(len(SEEDS), dtype=torch.int64, device="cuda")
    nodes = torch.arange(len(SEEDS), device="cuda")
    philox_uniform(seeds, offsets, nodes, PURPOSE_ACCEPT)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = philox_uniform(seeds, offsets, nodes, PURPOSE_ACCEPT)
    for step in (3, 2**40):
        offsets.fill_(step)
        graph.replay()
        assert torch.equal(out.cpu(), uniform(seeds.cpu(), torch.tensor(step), nodes.cpu(), PURPOSE_ACCEPT))


def test_exported():
    assert tlt_kernels.philox_uniform is philox_uniform and "philox_uniform" in tlt_kernels.__all__


# ----------------------------------------------------------------------------------------------- property
words = st.integers(-(2**63), 2**64 - 1)


@budget(10)
@given(st.data())
@pytest.mark.parametrize("backend", backend_params())
def test_property_matches_reference(backend, data):
    """Any 64-bit seeds and offsets (Python ints modulo 2**64), any 32-bit nodes and 31-bit purpose, in shapes that
    broadcast: the reference's bits."""
    n = data.draw(st.integers(0, 6), label="n")
    seeds = torch.tensor([(data.draw(words) + 2**63) % 2**64 - 2**63 for _ in range(n)], dtype=torch.int64)
    offset = data.draw(words, label="offset")
    nodes = torch.tensor(data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=4)), dtype=torch.int64)
    purpose = data.draw(st.integers(0, 2**31 - 1), label="purpose")
    got = philox_uniform(seeds.unsqueeze(1), offset, nodes, purpose, backend=backend)
    want = uniform(seeds.unsqueeze(1), offset, nodes, purpose)
    assert got.shape == (n, len(nodes)) and torch.equal(got, want)
