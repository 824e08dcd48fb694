"""optim=adamw8bit: the block-wise 8-bit quantizer (against torchao's reference), the optimizer against
torch's AdamW (each tensor its own blocks, small tensors in FP32), its state in the EPS (~10 bytes per
parameter, undo, checkpoints, exact resume), the config rules and the planner's bytes per parameter."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from l2l_cli.compose import compose
from l2l_cli.config.validate import validate
from l2l_cli.engine import adamw8bit as a8
from l2l_cli.engine import host_passes
from l2l_cli.engine.accelerators import make_accelerator
from l2l_cli.engine.flat import FlatLayout
from l2l_cli.engine.host_passes import AdamwStep, HostPasses
from l2l_cli.engine.layer_state import LayerState
from l2l_cli.engine.optim import MIN_8BIT, OPTIMIZERS, QBLOCK, OptimSettings
from l2l_cli.engine.qmaps import codec, native_qmap
from l2l_cli.plan.hardware import resolve
from l2l_cli.plan.knobs import Setup
from l2l_cli.plan.memory import memory
from l2l_cli.plan.planner import model_shape
from l2l_cli.plan.shapes import ModelShape
from l2l_cli.progress import summary_text
from l2l_cli.runfiles import Summary
from l2l_cli.train import run_job
from tests.test_l2l_p import assert_bitwise
from tests.test_l2l_p import run as run_l2l_p
from tests.util import built, l2l, tiny_cfg, train

# ---- the quantizer -------------------------------------------------------------------------------


def test_dynamic_maps_and_codes_equal_torchaos_reference() -> None:
    """Our maps are bitsandbytes' dynamic maps as torchao builds them, and our quantizer (absmax per block
    of 256, nearest code by binary search) gives torchao's codes and absmaxes, bit for bit."""
    ref = pytest.importorskip("torchao.optim.quant_utils")
    torch.manual_seed(0)
    for signed in (True, False):
        assert a8.dynamic_map(signed) == ref.create_dynamic_map(signed)
        n = 40 * a8.BLOCK
        x = torch.randn(n) * torch.logspace(-7, 0, n)[torch.randperm(n)]  # values over 7 decades
        x = x if signed else x.abs()
        qmap = a8.QuantMap(signed, torch.device("cpu"))
        codes, absmax = torch.empty(n, dtype=torch.uint8), torch.empty(n // a8.BLOCK)
        a8.quantize_(x, qmap, codes, absmax)
        scaled, ref_absmax = ref.scale_tensor(x, a8.BLOCK)
        ref_codes = ref.quantize_8bit_with_qmap(scaled, torch.tensor(ref.create_dynamic_map(signed)))
        assert torch.equal(absmax, ref_absmax) and torch.equal(codes, ref_codes)


def test_a_partial_last_block_and_an_all_zero_block_round_trip() -> None:
    qmap = a8.QuantMap(True, torch.device("cpu"))
    x = torch.randn(1000)  # 3 whole blocks and one of 232
    x[256:512] = 0.0
    codes, absmax = torch.empty(1000, dtype=torch.uint8), torch.empty(4)
    a8.quantize_(x, qmap, codes, absmax)
    assert absmax[1] == 0 and absmax[3] == x[768:].abs().max()
    back = a8.dequantize(codes, absmax, qmap)
    assert torch.equal(back[256:512], torch.zeros(256))
    # each value is its block's absmax times the map value nearest to it (the all-zero block aside)
    scale = absmax.repeat_interleave(a8.BLOCK)[:1000].clamp(min=1e-30)
    y = x / scale
    nearest = (y[:, None] - qmap.values[None, :]).abs().min(dim=1).values
    assert ((back / scale - y).abs() <= nearest + 1e-6).all()
    assert nearest.max() < 0.008  # half the widest gap of the signed map (64 codes in 0.1 .. 1)


# ---- the optimizer -------------------------------------------------------------------------------


def _adam_pair(n: int, steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.optim.Optimizer]:
    torch.manual_seed(1)
    w0 = torch.randn(n) * 0.02
    grads = [torch.randn(n) * torch.logspace(-3, 0, n) for _ in range(steps)]
    p8, p32 = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    opt8 = a8.AdamW8bit([p8], lr=1e-3, eps=1e-6, weight_decay=0.01)
    opt32 = torch.optim.AdamW([p32], lr=1e-3, eps=1e-6, weight_decay=0.01)
    for g in grads:
        p8.grad, p32.grad = g.clone(), g.clone()
        opt8.step()
        opt32.step()
    return (p8.detach() - w0), (p32.detach() - w0), opt8


def test_adamw8bit_follows_adamw_on_a_flat_buffer() -> None:
    """Step 1 starts from zero moments, which quantize exactly: AdamW's update to FP32 rounding. Later
    steps read the moments back from 8 bits: close to AdamW's, not equal. The state is uint8 codes and one
    FP32 absmax per block: about 2 bytes per parameter instead of 8."""
    n = 10_000  # not a multiple of 256
    d8, d32, _ = _adam_pair(n, 1)
    torch.testing.assert_close(d8, d32, rtol=1e-5, atol=1e-9)
    d8, d32, opt = _adam_pair(n, 5)
    assert not torch.equal(d8, d32)
    assert float((d8 - d32).norm() / d32.norm()) < 0.05
    st = next(iter(opt.state.values()))
    assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.uint8
    assert st["exp_avg_absmax"].numel() == -(-n // 256) and float(st["step"]) == 5
    assert sum(t.nbytes for k, t in st.items() if k != "step") / n == pytest.approx(2.03, abs=0.01)


def test_chunked_update_equals_one_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """The update walks the buffer in chunks (bounded FP32 temporaries): the same numbers as one pass. (A
    tensor of at least MIN_8BIT elements: a smaller one keeps FP32 moments and is not chunked.)"""
    whole, _, opt = _adam_pair(5000, 3)
    assert next(iter(opt.state.values()))["exp_avg"].dtype == torch.uint8
    monkeypatch.setattr(a8, "CHUNK", 512)
    assert torch.equal(_adam_pair(5000, 3)[0], whole)


# ---- each tensor its own blocks, small ones in FP32 (issue 52, item 5) ----------------------------------


class _Layer(nn.Module):
    """A layer whose flat buffer puts tensors with 1e-4x smaller gradients right after a large weight: in
    one flat run they would share its last block (6000 elements: 23 whole blocks and 112 more)."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(60, 100, bias=False)  # 6000 elements, gradients ~1
        self.mid = nn.Linear(64, 70, bias=False)  # 4480: 8-bit moments in its own blocks, gradients ~1e-4
        self.small = nn.Linear(10, 10, bias=False)  # 100: FP32 moments, gradients ~1e-4
        self.norm = nn.LayerNorm(60)  # no weight decay, gradients ~1e-4
        for p in self.parameters():
            nn.init.normal_(p, std=0.02)


GRAD_SCALE = {
    "big.weight": 1.0,
    "mid.weight": 1e-4,
    "small.weight": 1e-4,
    "norm.weight": 1e-4,
    "norm.bias": 1e-4,
}
OPT = OptimSettings("adamw8bit", 1e-3, 0.01, 0.9, 0.999, 1e-8, 0.0, 0, "constant")


def _grads(steps: int, layout: FlatLayout) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        g = torch.empty(layout.numel)
        for e in layout.entries:
            g[e.offset : e.offset + e.numel] = torch.randn(e.numel, generator=gen) * GRAD_SCALE[e.name]
        out.append(g)
    return out


def _eps_run(steps: int) -> tuple[dict[str, torch.Tensor], LayerState]:
    """``steps`` updates of the layer as the EPS makes them (its flat buffers, ``LayerState.update``)."""
    torch.manual_seed(0)
    layer = _Layer()
    layout = FlatLayout(layer)
    st = LayerState(1, "block", layout, make_accelerator("cpu"), torch.float32, OPT)
    layout.pack(layer, st.w)
    for g in _grads(steps, layout):
        st.g.copy_(g)
        st.update(OPT.lr, None)
    return {n: t.clone() for n, t in layout.views(st.w)}, st


def _per_tensor_run(steps: int, make: type[torch.optim.Optimizer]) -> dict[str, torch.Tensor]:
    """The same updates by ``make`` over the layer's separate tensors (a baseline's optimizer)."""
    torch.manual_seed(0)
    layer = _Layer()
    layout = FlatLayout(layer)
    named = dict(layer.named_parameters())
    decay = [p for n, p in named.items() if not n.startswith("norm")]
    nodecay = [p for n, p in named.items() if n.startswith("norm")]
    opt = make(
        [{"params": decay, "weight_decay": 0.01}, {"params": nodecay, "weight_decay": 0.0}], lr=1e-3, eps=1e-8
    )
    for g in _grads(steps, layout):
        for n, view in layout.views(g):
            named[n].grad = view.clone()
        opt.step()
    return {n: p.detach().clone() for n, p in named.items()}


def test_a_small_tensor_beside_a_large_one_tracks_adamw() -> None:
    """Acceptance (issue 52, item 5): tensors whose gradients are 1e-4x those of the large weight before them
    in the layer's flat buffer follow AdamW within 1e-2 over 50 steps, each tensor, while AdamW moves each by
    far more than that. (Blocks shared across tensors failed this: the small tensors' v rounded to 0 in a
    block scaled by the large one while m did not, and their update became m / eps.)"""
    init = _per_tensor_run(0, torch.optim.AdamW)
    got, st = _eps_run(50)
    want = _per_tensor_run(50, torch.optim.AdamW)
    for name, w in want.items():
        moved = float((w - init[name]).norm() / init[name].norm())
        err = float((got[name] - w).norm() / w.norm())
        assert moved > 0.1 and err < 1e-2, (name, moved, err)
    at = {p.data_ptr(): p for g in st.optimizer.param_groups for p in g["params"]}
    state = {n: st.optimizer.state[at[t.data_ptr()]] for n, t in st.layout.views(st.w)}
    assert state["mid.weight"]["exp_avg_sq"].dtype == torch.uint8  # 4480 >= MIN_8BIT: 8-bit, its own blocks
    assert state["small.weight"]["exp_avg_sq"].dtype == torch.float32  # 100 < MIN_8BIT: FP32 moments
    assert MIN_8BIT == 4096


def test_the_eps_and_the_baselines_block_each_tensor_alike() -> None:
    """The EPS's flat buffers give each tensor the state a baseline's optimizer creates for it (its own
    blocks; FP32 moments under MIN_8BIT): the same weights, bit for bit."""
    got, st = _eps_run(5)
    want = _per_tensor_run(5, a8.AdamW8bit)
    assert all(torch.equal(got[n], want[n]) for n in want)
    n_big = [e.numel for e in st.layout.entries if e.numel >= MIN_8BIT]
    n_small = [e.numel for e in st.layout.entries if e.numel < MIN_8BIT]
    assert st.m.numel() == sum(n_big) and st.m.dtype == torch.uint8
    assert st.extra["m_absmax"].numel() == sum(-(-n // 256) for n in n_big)  # a partial block per tensor
    assert st.extra["m_fp32"].numel() == sum(n_small) and st.extra["m_fp32"].dtype == torch.float32


def test_load_state_dict_keeps_the_codes_uint8() -> None:
    """``Optimizer.load_state_dict`` casts every state tensor of a float parameter to its dtype; 8-bit
    AdamW's keeps the uint8 codes (and its FP32 absmaxes) as saved, and training continues bit for bit."""
    torch.manual_seed(3)
    grads = [torch.randn(5000) for _ in range(5)]

    def fresh() -> tuple[torch.nn.Parameter, a8.AdamW8bit]:
        p = torch.nn.Parameter(torch.linspace(-1, 1, 5000))
        return p, a8.AdamW8bit([p], lr=1e-2)

    p, opt = fresh()
    for g in grads:
        p.grad = g.clone()
        opt.step()
    q, resumed = fresh()
    for g in grads[:3]:
        q.grad = g.clone()
        resumed.step()
    saved = resumed.state_dict()
    q2, opt2 = fresh()
    q2.data.copy_(q.data)
    opt2.load_state_dict(saved)
    st = opt2.state[q2]
    assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.uint8
    assert st["exp_avg_absmax"].dtype == torch.float32 and float(st["step"]) == 3
    for g in grads[3:]:
        q2.grad = g.clone()
        opt2.step()
    assert torch.equal(q2.data, p.data)


# ---- the update in one pass (issue 52, item 6) ---------------------------------------------------


def test_the_native_update_equals_the_torch_ops_bit_for_bit() -> None:
    """Where the C kernels build, 8-bit AdamW's update runs in them (one pass per block of 256) and gives
    the torch-ops update's weights, codes, absmaxes and send copy bit for bit: a half gradient times a
    factor, a partial last block, a tensor whose size leaves torch's fused kernel a scalar tail, and a NaN
    in one block's gradient (its absmaxes NaN and its codes 255, as torch.amax and bucketize give)."""
    assert host_passes.QBLOCK == a8.BLOCK == QBLOCK == 256  # the kernel's block is the state's
    assert a8.MIN_8BIT == MIN_8BIT
    passes = HostPasses(1)
    if passes.lib is None:
        pytest.skip(f"no native kernels here: {passes.why}")
    assert a8._native_maps(passes) is not None  # checked against the torch ops, and used
    gen = torch.Generator().manual_seed(5)
    for n, nan_at in ((20 * 256, None), (20 * 256 + 77, None), (20 * 256, 3 * 256 + 5)):
        w0 = torch.randn(n, generator=gen) * 0.02
        grads = [(torch.randn(n, generator=gen) * torch.logspace(-6, 0, n)).bfloat16() for _ in range(4)]
        if nan_at is not None:
            grads[2][nan_at] = float("nan")
        out = []
        for native in (True, False):
            w = w0.clone()
            opt = a8.AdamW8bit([torch.nn.Parameter(torch.zeros(1))], passes=passes)
            st = a8.new_state(torch.nn.Parameter(w))
            send = torch.empty(n, dtype=torch.bfloat16)
            maps = opt.maps(torch.device("cpu"))
            for k, g in enumerate(grads, 1):
                hp = AdamwStep(1e-3, 0.9, 0.999, 1e-8, 0.01, float(k))
                kept = g.clone()
                if native:
                    opt.update(w, g, st, hp, 0.25, send)
                else:
                    a8.update_torch(w, g, st, hp, 0.25, send, maps)
                assert same_bits(g, kept)  # the gradient is left as it arrived
            out.append((w, send, st))
        (w, send, st), (w_ref, send_ref, st_ref) = out
        assert same_bits(w, w_ref) and same_bits(send, send_ref) and not torch.equal(w, w0)
        assert all(same_bits(st[k], st_ref[k]) for k in st), n
        if nan_at is not None:
            assert st["exp_avg_absmax"][3].isnan() and (st["exp_avg"][3 * 256 : 4 * 256] == 255).all()
            assert not st["exp_avg_absmax"][2].isnan() and w[: 3 * 256].isfinite().all()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaNs where the other has a NaN (any payload) counted equal."""
    nan = a.isnan() if a.is_floating_point() else torch.zeros_like(a, dtype=torch.bool)
    bnan = b.isnan() if b.is_floating_point() else nan
    return torch.equal(nan, bnan) and torch.equal(a[~nan], b[~nan])


def test_the_native_quantizer_gives_bucketizes_codes_at_every_midpoint() -> None:
    """The kernel's quantizer (a table on the float's top bits and a few integer operations) against the
    binary search (``torch.bucketize``, right=True) on every midpoint of both maps, the floats a few ulps
    either side, and 0, -0, tiny, 1, above 1, infinities and NaN: the same code for each."""
    passes = HostPasses(1)
    if passes.lib is None:
        pytest.skip(f"no native kernels here: {passes.why}")
    for signed in (True, False):
        ref = a8.QuantMap(signed, torch.device("cpu"))
        qmap = native_qmap(passes.lib, ref.values, ref.mids)
        assert qmap is not None
        bits = ref.mids.view(torch.int32)
        near = torch.cat([(bits + d).view(torch.float32) for d in range(-3, 4)])
        special = [0.0, -0.0, 1e-30, -1e-30, 1e-7, -1e-7, 1.0, -1.0, 1.5, -1.5, float("inf"), -float("inf")]
        x = torch.cat([near, -near, torch.tensor(special), torch.full((1,), float("nan"))])
        x = torch.cat([x, torch.randn(4096) * torch.logspace(-8, 0, 4096)]).contiguous()
        for scale in (1.0, 0.37):
            want = torch.bucketize(x / scale, ref.mids, out_int32=True, right=True).to(torch.uint8)
            assert torch.equal(codec(passes.lib, x, scale, qmap), want), signed


def test_the_native_dequantizer_gives_each_codes_map_value() -> None:
    """The kernel's dequantizer (on AVX-512 VBMI a lookup of the values' byte planes in registers, 64 codes
    at a time, the codes permuted so the floats come out in order; else a gather) against the map: every
    code, in a scrambled order and at every offset within the 64-code group and the tail, gives
    ``values[code] * absmax`` bit for bit."""
    passes = HostPasses(1)
    if passes.lib is None:
        pytest.skip(f"no native kernels here: {passes.why}")
    gen = torch.Generator().manual_seed(0)
    for signed in (True, False):
        ref = a8.QuantMap(signed, torch.device("cpu"))
        qmap = native_qmap(passes.lib, ref.values, ref.mids)
        assert qmap is not None
        codes = torch.cat([torch.randperm(256, generator=gen) for _ in range(3)]).to(torch.uint8)
        for n in (len(codes), 64, 63, 200, 17):
            c = codes[:n].contiguous()
            for absmax in (1.0, 0.37, 3.5e-7):
                want = ref.values[c.long()] * absmax
                got = codec(passes.lib, c, absmax, qmap)
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (signed, n, absmax)


def test_the_eps_update_is_one_pass_from_the_half_gradient() -> None:
    """Under CMP the EPS's 8-bit update reads the BF16 gradient as it crossed the link, folds in the
    unscale/clip factor and writes the device's BF16 copy in the same pass: nothing widened or scaled
    apart, the gradient left as it arrived (a redo re-reads it), ~16 bytes per parameter (AdamW's: 28);
    the weights those of the same update from the FP32 gradient."""
    torch.manual_seed(0)
    layer = _Layer()
    layout = FlatLayout(layer)
    st = LayerState(1, "block", layout, make_accelerator("cpu"), torch.bfloat16, OPT)
    ref = LayerState(1, "block", layout, make_accelerator("cpu"), torch.float32, OPT)
    layout.pack(layer, st.w)
    ref.w.copy_(st.w)
    steps = 3
    for g in _grads(steps, layout):
        st.recv.copy_(g)
        sent = st.recv.clone()
        st.receive_grad()
        st.update(OPT.lr, 0.5)
        assert torch.equal(st.recv, sent)
        ref.g.copy_(sent.float())
        ref.update(OPT.lr, 0.5)
    assert st.update_keeps_grad
    assert torch.equal(st.w, ref.w) and torch.equal(st.w_send, st.w.bfloat16())
    counted = st.passes.snapshot()[0]
    assert "widen" not in counted and "scale" not in counted and "refresh" not in counted
    assert (
        16 < counted["update"] / (steps * layout.numel) < 17
    )  # 2 + 8 + 2 + ~4.3 (codes, small FP32 moments)


# ---- in the modes (acceptance: 3 steps within 1e-2 of AdamW) ----------------------------------------

LR = "optim.lr=5e-3"  # AdamW's three steps move the tiny model's weights ~8%, well beyond the 1e-2 tolerance
# the tiny model 64 wide: its blocks' matrices hold 4096 elements or more, so they keep 8-bit moments (32
# wide, every tensor of its blocks is under MIN_8BIT and keeps FP32 moments: only the embeddings would be
# 8-bit)
WIDE = ("model.hidden_size=64", "model.intermediate_size=128")


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over all the model's weights."""
    num = sum(float(((a[k] - b[k]) ** 2).sum()) for k in b)
    return (num / sum(float((b[k] ** 2).sum()) for k in b)) ** 0.5


@functools.cache
def _init_weights() -> dict[str, torch.Tensor]:
    with built(tiny_cfg("mode=l2l", *WIDE)) as runner:
        return {n: t.detach().float().clone() for n, t in runner.hf_tensors()}


@pytest.mark.parametrize("mode", ["l2l", "baseline_ag"])
def test_three_steps_within_1e_2_of_adamw(mode: str) -> None:
    ref = train(tiny_cfg(f"mode={mode}", LR, "optim=adamw", *WIDE))
    got = train(tiny_cfg(f"mode={mode}", LR, "optim=adamw8bit", *WIDE))
    assert _rel(ref["weights"], _init_weights()) > 0.05  # AdamW moved the weights 5x the tolerance
    assert got["losses"][0] == ref["losses"][0]  # same start
    assert 0 < _rel(got["weights"], ref["weights"]) < 1e-2


def test_l2l_p_rollback_and_skipped_step_restore_the_8bit_state_exactly() -> None:
    """L2L-p's speculative update, its undo (codes and absmaxes) and redo: L2L's weights bit for bit, with a
    clipped step rolled back and a step skipped for an inf gradient."""
    # norms 0.469, 0.451, inf, 0.728: step 1 clips only once every layer is in (its speculative updates
    # are undone and redone with the factor), step 3 is skipped, step 4 clips with certainty early (deferred)
    over = ("optim=adamw8bit", "optim.max_grad_norm=0.46", *WIDE)
    got = run_l2l_p("l2l_p", *over, steps=4, poison_step=3)
    assert_bitwise(got, run_l2l_p("l2l", *over, steps=4, poison_step=3))
    assert got["sections"]["l2l_p"]["rollbacks"] == 2  # step 1 clipped, step 3 skipped


# ---- run files: host bytes per parameter, checkpoints, exact resume --------------------------------

RUN = ["trainer.max_steps=4", "trainer.save_every=2", "task.num_train=64", "task.num_eval=16"]


def test_l2l_p_under_cmp_equals_l2l_with_the_8bit_state() -> None:
    """CMP: the half gradients cross the link and the 8-bit update reads them as they are (one pass, the
    factor folded in, the half copy written); L2L-p's speculative updates, undone and redone with the
    clipping factor, and a skipped step give L2L's weights bit for bit."""
    over = ("optim=adamw8bit", "precision=cmp", "optim.max_grad_norm=0.46", *WIDE)
    got = run_l2l_p("l2l_p", *over, steps=4, poison_step=3)
    assert_bitwise(got, run_l2l_p("l2l", *over, steps=4, poison_step=3))
    assert [r.skipped for r in got["reports"]] == [False, False, True, False]


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@functools.cache
def _tensor_sizes() -> list[list[int]]:
    """The elements of each trained tensor, layer by layer, of the 64-wide tiny model."""
    with built(tiny_cfg("mode=l2l", "optim=adamw8bit", *WIDE)) as runner:
        return [[e.numel for e in st.layout.entries] for st in runner.eps.layers]


@pytest.mark.parametrize("mode", ["l2l", "baseline_ag"])
def test_resume_is_exact_and_checkpoints_hold_codes_and_absmax(tmp_path: Path, mode: str) -> None:
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert run_job(tiny_cfg(f"mode={mode}", "optim=adamw8bit", *WIDE, *RUN), full) == "ok"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step_4")
    resume = f"trainer.resume={cut}"
    assert run_job(tiny_cfg(f"mode={mode}", "optim=adamw8bit", *WIDE, *RUN, resume), cut) == "ok"
    a, b = (d / "checkpoints" / "step_4" for d in (full, cut))
    files = sorted(p.name for p in a.glob("*.safetensors"))
    assert files == sorted(p.name for p in b.glob("*.safetensors")) and files
    for name in files:
        ta, tb = load_file(a / name), load_file(b / name)
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), name
    sizes = _tensor_sizes()
    if mode == "l2l":  # the EPS's layer file: w, m, v, m_absmax, v_absmax (8-bit tensors), m_fp32, v_fp32
        state = load_file(a / "layer_1.safetensors")
        big = [n for n in sizes[1] if n >= MIN_8BIT]
        assert state["m"].numel() == state["v"].numel() == sum(big)
        assert state["m_absmax"].numel() == sum(-(-n // 256) for n in big)  # each tensor its own blocks
        assert state["m_fp32"].numel() == sum(n for n in sizes[1] if n < MIN_8BIT) > 0
        codes, absmax, small = state["m"], state["m_absmax"], state["v_fp32"]
    else:  # the module layout: <name>.exp_avg, <name>.exp_avg_absmax, ...
        state = load_file(a / "optimizer.safetensors")
        name = next(k for k in state if k.endswith(".exp_avg_absmax")).removesuffix(".exp_avg_absmax")
        codes, absmax = state[f"{name}.exp_avg"], state[f"{name}.exp_avg_absmax"]
        assert absmax.numel() == -(-codes.numel() // 256)
        small = next(t for k, t in state.items() if k.endswith(".exp_avg_sq") and t.numel() < MIN_8BIT)
    assert codes.dtype == torch.uint8 and absmax.dtype == torch.float32 and small.dtype == torch.float32
    s = _summary(full)
    if mode == "l2l":  # the EPS's measured bytes: master 4 + gradient 4, and per 8-bit tensor codes 2 +
        # absmax 8 per block, per smaller tensor FP32 moments 8
        every = [n for layer in sizes for n in layer]
        state_bytes = sum(2 * n + 8 * -(-n // 256) if n >= MIN_8BIT else 8 * n for n in every)
        want = 8 + state_bytes / sum(every)
        assert 10.0 < want < 10.5 and s["host_bytes_per_param"] == pytest.approx(want, rel=1e-9)
    else:  # the baselines keep no state on the host
        assert s["host_bytes_per_param"] is None


def test_host_bytes_per_param_is_16_with_adamw(tmp_path: Path) -> None:
    assert (
        run_job(tiny_cfg("mode=l2l", "trainer.max_steps=1", "task.num_train=16", "task.num_eval=8"), tmp_path)
        == "ok"
    )
    summary = _summary(tmp_path)
    assert summary["host_bytes_per_param"] == pytest.approx(16.0, abs=1e-9)  # 4 + 4 + 4 + 4, measured
    table = summary_text(Summary.from_json(summary))
    assert "host state" in table and "16.00 B/param (master, gradient, optimizer, adamw)" in table


# ---- bad input and the planner ---------------------------------------------------------------------


def test_the_pipeline_refuses_adamw8bit_in_one_line_and_the_disk_tier_takes_it(tmp_path: Path) -> None:
    """A pipeline stage keeps FP32 moments: one config line. The disk tier holds 8-bit AdamW's state
    (format 3, tests/test_disk_adamw8bit.py): no problem."""
    assert [str(p) for p in validate(tiny_cfg("optim=adamw8bit", "eps.tier=disk"), check_files=False)] == []
    pipe = [
        str(p)
        for p in validate(tiny_cfg("optim=adamw8bit", "dist.nproc=2", "dist.pipeline=2"), check_files=False)
    ]
    assert any(p.startswith("optim.name: adamw8bit is not available with dist.pipeline > 1") for p in pipe)
    run_dir = tmp_path / "run"
    out = l2l("train", "optim=adamw8bit", "dist.nproc=2", "dist.pipeline=2", f"hydra.run.dir={run_dir}")
    assert out.returncode == 2 and not run_dir.exists()
    lines = [line for line in out.stderr.splitlines() if line.startswith("l2l:")]
    assert len(lines) == 1 and "dist.pipeline > 1" in lines[0]
    assert "Traceback" not in out.stderr


def test_the_planner_counts_adamw8bits_bytes_per_parameter() -> None:
    assert OPTIMIZERS["adamw"].state_bytes_per_param == 8
    assert OPTIMIZERS["adamw8bit"].state_bytes_per_param == pytest.approx(2 + 8 / 256)
    shape = ModelShape.bert(24, 1024, 16, 4096)
    P = shape.total_params
    for mode, where in (("l2l", "host"), ("baseline", "device")):
        s = Setup(mode, "device" if mode == "l2l" else None, True, "fp32", 128, 8, 8)
        fp32 = memory(shape, s)[where]["training_state"]
        q8 = memory(shape, s.but(optim="adamw8bit"))[where]["training_state"]
        assert fp32 == 16 * P and q8 == pytest.approx((10 + 8 / 256) * P)


def test_the_planner_times_the_optimizer_the_run_uses() -> None:
    """Without a measured machine the planner charges the run's own optimizer for the host update:
    adamw8bit's is its ``host_update_cost`` times AdamW's (what benchmarks/optimizers.py measures), where
    it used to get AdamW's time."""
    times = {}
    for name in ("adamw", "adamw8bit"):
        cfg = compose(["model=llama-7b", "task=lm", f"optim={name}"])
        shape, _ = model_shape(cfg)
        times[name] = resolve(cfg, shape).host_update_time(shape.total_params)
    cost = OPTIMIZERS["adamw8bit"].host_update_cost
    assert cost != 1.0 and OPTIMIZERS["adamw"].host_update_cost == 1.0
    assert times["adamw8bit"] == pytest.approx(times["adamw"] * cost, rel=1e-12)
