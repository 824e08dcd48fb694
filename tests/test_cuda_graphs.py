"""``mode.cuda_graphs`` (engine/graphs.py): the L2L runners' blocks as captured graphs.

A CPU has no CUDA graphs; these tests run the runner's graph path through ``EagerBackend``, the stand-in
whose "replay" runs the captured function again and copies its outputs into the static ones. What they
check is everything around a graph: static inputs and cloned outputs, gradients accumulated in place in the
slot, dropout seeds read at replay, one graph serving every layer of a slot, the capture-time check and the
fall back to eager blocks. ``scripts/gpu_check.sh`` runs the real graphs on a GPU against eager blocks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from l2l_cli.config.validate import validate
from l2l_cli.engine import graphs
from tests.test_adapters import lm_batches
from tests.util import batches, built, tiny_cfg, weights


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Graphs "supported" on this CPU, made by the eager stand-in (or the backend a test sets)."""
    made: dict[str, Any] = {"backend": graphs.EagerBackend}
    monkeypatch.setattr(graphs, "supported", lambda kind: True)
    monkeypatch.setattr(graphs, "backend_for", lambda kind, device: made["backend"]())
    return made


def run(cfg: Any, steps: int = 3) -> tuple[dict[str, torch.Tensor], list[float], dict[str, Any] | None]:
    """Final weights, losses and the summary's ``cuda_graphs`` section of ``steps`` steps."""
    lm = cfg.model.family != "bert"
    with built(cfg) as runner:
        it = iter(lm_batches(cfg, steps)) if lm else batches(cfg)
        losses = [runner.step(next(it)).loss for _ in range(steps)]
        section = runner.sections().get("cuda_graphs")
        return weights(runner), losses, section


CASES = {
    "l2l-fp32-dropout": ["mode=l2l", "model.dropout=0.1"],
    "l2l_p-cmp-stash_cpu": ["mode=l2l_p", "precision=cmp", "mode.stash=cpu", "model.dropout=0.1"],
    "l2l-amp-llama": ["model=llama-tiny", "task=lm", "precision=amp"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_graphs_train_to_the_eager_blocks_weights_bit_for_bit(stand_in: Any, case: str) -> None:
    """Three steps with every block's forward and backward through its graph equal three eager steps bit
    for bit (dropout drawn at each replay from the per-layer, per-micro-batch seed; a decoder's side inputs,
    a dataclass of masks and rotary tables, copied in), and the summary counts the replays."""
    over = [*CASES[case], "task.pad_to_max=true", "batch.ubatch_size=2"]
    eager_w, eager_loss, none = run(tiny_cfg(*over, "mode.cuda_graphs=off"))
    graph_w, graph_loss, section = run(tiny_cfg(*over, "mode.cuda_graphs=on"))
    assert none is None
    assert section is not None and section["off_reason"] is None
    assert section["captured"] >= 4 and section["replays"] > 10 * section["captured"]
    assert graph_loss == eager_loss
    assert eager_w.keys() == graph_w.keys()
    assert all(torch.equal(eager_w[k], graph_w[k]) for k in eager_w)


class Wrong(graphs.EagerBackend):
    """A graph whose replay is off by a little (what a capture that went wrong would give)."""

    def capture(self, fn: Any) -> Any:
        replay, out = super().capture(fn)

        def off() -> None:
            replay()
            for t in graphs.leaves(out):
                t.add_(1e-3)

        return off, out


class Refused(graphs.EagerBackend):
    def capture(self, fn: Any) -> Any:
        raise RuntimeError("operation not permitted when stream is capturing\nCUDA kernel errors ...")


@pytest.mark.parametrize(("backend", "reason"), [(Wrong, "first replay differs"), (Refused, "not permitted")])
def test_a_graph_that_fails_its_check_turns_graphs_off_and_the_eager_result_stands(
    stand_in: Any, caplog: pytest.LogCaptureFixture, backend: type, reason: str
) -> None:
    """A graph whose first replay differs from the eager block, or that cannot be captured: the run goes on
    with eager blocks, its weights those of a run without graphs, and the log and the summary say why."""
    over = ["mode=l2l", "task.pad_to_max=true", "model.dropout=0.1"]
    eager_w, _, _ = run(tiny_cfg(*over, "mode.cuda_graphs=off"))
    stand_in["backend"] = backend
    got_w, _, section = run(tiny_cfg(*over, "mode.cuda_graphs=on"))
    assert section is not None and reason in section["off_reason"] and section["replays"] == 0
    assert "\n" not in section["off_reason"]
    assert "cuda graphs off for this run" in caplog.text
    assert all(torch.equal(eager_w[k], got_w[k]) for k in eager_w)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.tanh(self.lin(x))) * mask


def test_one_graph_per_shape_up_to_the_cap_then_eager_blocks(caplog: pytest.LogCaptureFixture) -> None:
    """Each new shape is captured until ``MAX_SHAPES``; later shapes run eagerly (said once); every call's
    results (output, input gradient, accumulated parameter gradients) equal the eager block's."""
    caplog.set_level("INFO", logger="l2l")
    torch.manual_seed(0)
    block = Block()
    for p in block.parameters():
        p.grad = torch.zeros_like(p)
    ref = Block()
    ref.load_state_dict(block.state_dict())
    for p in ref.parameters():
        p.grad = torch.zeros_like(p)

    def fwd(layer: nn.Module, i: int, x: torch.Tensor, side: Any) -> torch.Tensor:
        return layer(x, side)

    bg = graphs.BlockGraphs(graphs.EagerBackend(), fwd, torch.random.default_generator, lambda i: None)
    for rows in [1, 2, 1, 3, 4, 5, 6, 2, 6]:
        x, mask, gy = torch.randn(rows, 8), torch.rand(rows, 8), torch.randn(rows, 8)
        torch.manual_seed(rows)
        with torch.no_grad():
            y = bg.forward(block, 1, x, mask)
        torch.manual_seed(rows)
        dx = bg.backward(block, 1, x, mask, gy)
        torch.manual_seed(rows)
        with torch.no_grad():
            y_ref = ref(x, mask)
        torch.manual_seed(rows)
        x_ref = x.clone().requires_grad_()
        torch.autograd.backward(ref(x_ref, mask), gy)
        assert torch.equal(y, y_ref) and torch.equal(dx, x_ref.grad)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(block.parameters(), ref.parameters()))
    assert bg.captured == 2 * graphs.MAX_SHAPES  # shapes 1-4, forward and backward; 5 and 6 eager
    assert bg.replays == 2 * 2  # the second 1 and 2; the second 6 is past the cap
    assert bg.off_reason is None and caplog.text.count("blocks of other shapes run eagerly") == 1


def test_blocks_whose_code_reads_their_index_get_graphs_of_their_own() -> None:
    """A graph replays the code path it captured: blocks whose ``variant`` differs (a sliding-window layer
    beside a full-attention one) each get their own, and both agree with the eager block."""
    torch.manual_seed(0)
    block = Block().eval()

    def fwd(layer: nn.Module, i: int, x: torch.Tensor, side: Any) -> torch.Tensor:
        return layer(x, side if i % 2 else side.tril())

    bg = graphs.BlockGraphs(graphs.EagerBackend(), fwd, torch.random.default_generator, lambda i: i % 2)
    x, mask = torch.randn(8, 8), torch.rand(8, 8)
    with torch.no_grad():
        for i in [1, 2, 3, 4]:
            assert torch.equal(bg.forward(block, i, x, mask), fwd(block, i, x, mask))
    assert bg.captured == 2 and bg.replays == 2


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["mode.cuda_graphs=on"], "mode.cuda_graphs: on needs a CUDA device; this run's is device=cpu"),
        (["mode.cuda_graphs=yes"], "mode.cuda_graphs: got 'yes'; allowed: auto, on, off"),
        (["mode=baseline_ag", "mode.cuda_graphs=on"], "mode.cuda_graphs: on applies to the L2L modes"),
    ],
)
def test_cuda_graphs_on_where_they_cannot_run_is_one_config_line(overrides: list[str], expected: str) -> None:
    cfg = tiny_cfg("device=cpu", *overrides)
    got = [str(p) for p in validate(cfg, check_files=False)]
    assert len(got) == 1 and got[0].startswith(expected), got


def test_auto_is_off_on_a_cpu_and_on_cuda_only_for_short_blocks() -> None:
    """``auto``: never on a CPU; on CUDA where a block's forward on a micro-batch is short (BERT-Large at
    8 x 512 tokens), not where it is compute-bound (BERT-Large at 32 x 512, a Llama-3-8B block at 2048)."""
    with built(tiny_cfg("mode=l2l")) as runner:
        assert runner.block_graphs is None and "cuda_graphs" not in runner.sections()
    bert_large, llama_8b = 12.6e6, 218e6  # a block's weights

    def auto(kind: str, tokens: int, weights: float) -> bool:
        return graphs.wanted("auto", kind, 2 * tokens * weights)

    assert auto("cuda", 8 * 512, bert_large) and not auto("cuda", 32 * 512, bert_large)
    assert not auto("cuda", 2048, llama_8b)
    assert not auto("cpu", 1, 1) and not auto("sim", 1, 1)
    assert graphs.wanted("on", "cuda", 1e15) and not graphs.wanted("off", "cuda", 1)


def test_the_cuda_backend_calls_torch_cuda_as_its_signatures_say(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA backend on a CPU, torch.cuda's graph API replaced by recorders whose signatures are checked
    against the real ones: one pool for every graph, thread-local capture (the relay's and the EPS's
    threads keep working), warm-up on a side stream that waits for the compute stream and is waited for."""
    import inspect

    real = inspect.signature(torch.cuda.graph.__init__).parameters
    assert {"pool", "capture_error_mode"} <= real.keys()
    log: list[Any] = []

    class Stream:
        def __init__(self, device: Any = None) -> None:
            self.name = "side" if device is not None else "main"

        def wait_stream(self, other: Any) -> None:
            log.append(("wait", self.name, other.name))

    class Graph:
        def replay(self) -> None:
            log.append("replay")

    class Capture:
        def __init__(
            self, graph: Any, pool: Any = None, stream: Any = None, capture_error_mode: str = ""
        ) -> None:
            log.append(("capture", pool, capture_error_mode))

        def __enter__(self) -> None: ...

        def __exit__(self, *exc: object) -> None: ...

    class On:
        def __init__(self, stream: Any) -> None:
            log.append(("on", stream.name))

        def __enter__(self) -> None: ...

        def __exit__(self, *exc: object) -> None: ...

    for name, fake in {
        "graph_pool_handle": lambda: "pool",
        "CUDAGraph": Graph,
        "graph": Capture,
        "Stream": Stream,
        "current_stream": lambda device: Stream(),
        "stream": On,
    }.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    backend = graphs.CudaBackend(torch.device("cuda", 0))
    ran: list[int] = []
    backend.warmup(lambda: ran.append(1))
    replay, out = backend.capture(lambda: "static")
    replay()
    assert out == "static" and len(ran) == graphs.WARMUP
    assert log == [
        ("wait", "side", "main"),
        ("on", "side"),
        ("wait", "main", "side"),
        ("capture", "pool", "thread_local"),
        "replay",
    ]
