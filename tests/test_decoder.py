"""Decoder language models (GPT-2 and Llama families) in every mode: equivalence with baseline_ag, CMP
training, the Hugging Face export, unsupported checkpoints refused, device memory flat in depth.

The checkpoints are tiny random GPT-2 (tied head) and Llama (grouped-query attention, untied head) models
written with ``save_pretrained`` into a temp dir, with the bundled tokenizer, and loaded back by path.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig

from l2l_cli.data.batches import TrainStream
from l2l_cli.data.lm import BUNDLED_TOKENIZER
from l2l_cli.data.loading import load_task
from l2l_cli.data.tasks import TaskData
from l2l_cli.models import POST
from l2l_cli.session import build
from tests.util import assert_same_weights, l2l, tiny_cfg, train

LM = ["task=lm", "task.max_seq_len=16", "batch.size=8", "batch.ubatch_size=2", "model.dropout=0.1"]


def write_checkpoint(kind: str, root: Path, **sizes: object) -> Path:
    """A random tiny ``kind`` causal LM saved as a Hugging Face directory (config, weights, tokenizer)."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = GPT2Config(n_layer=3, n_embd=32, n_head=2, n_inner=64, vocab_size=2048, n_positions=64, **sizes)
        model = GPT2LMHeadModel(cfg)
    else:
        cfg = LlamaConfig(
            num_hidden_layers=3,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            vocab_size=2048,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            **sizes,
        )
        model = LlamaForCausalLM(cfg)
    path = root / kind
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(BUNDLED_TOKENIZER).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("decoders")
    return {kind: write_checkpoint(kind, root) for kind in ("gpt2", "llama")}


def cfg_for(path: Path, *overrides: str) -> DictConfig:
    return tiny_cfg(*LM, f"model.pretrained={path}", *overrides)


@functools.cache
def lm_data(path: Path) -> TaskData:
    """The bundled corpus, tokenized with the checkpoint's tokenizer into 16-token blocks."""
    cfg = cfg_for(path)
    data = load_task(cfg.task, cfg.model)
    data.dev = data.dev.subset(16)
    return data


@functools.cache
def reference(path: Path, clip: str) -> dict:
    return train(cfg_for(path, "mode=baseline_ag", f"optim.clip={clip}"), data=lm_data(path))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize(
    ("mode", "extra", "clip"),
    [
        ("l2l", [], "global"),
        ("l2l_p", [], "layer"),
        ("l2l_p", [], "global"),
        ("l2l", ["mode.stash=cpu"], "global"),
        ("l2l_p", ["eps.tier=disk"], "layer"),
    ],
    ids=["l2l", "l2l_p-layer-clip", "l2l_p-global-clip", "l2l-stash-cpu", "l2l_p-disk-tier"],
)
def test_decoder_modes_match_baseline_ag(
    ckpt: dict[str, Path], kind: str, mode: str, extra: list, clip: str
) -> None:
    """3 steps from the checkpoint's weights, dropout 0.1 (the same masks in every mode): the same weights.
    GPT-2's head is tied: one master in the EPS, the head's gradient summed into the embedding's (on the
    disk tier too, where the pre layer is pinned while the head loads its tensors)."""
    path = ckpt[kind]
    got = train(cfg_for(path, f"mode={mode}", f"optim.clip={clip}", *extra), data=lm_data(path))
    ref = reference(path, clip)
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert_same_weights(got["weights"], ref["weights"])
    assert ("lm_head.weight" in got["weights"]) == (kind == "llama")  # a tied head is saved once


def test_tied_head_has_one_master_and_moves_with_both_gradients(ckpt: dict[str, Path]) -> None:
    """The EPS keeps the tied tensor once (the post layer's flat buffer is the final LayerNorm only), and
    the embedding's update differs from one that saw only the input-side gradient."""
    path = ckpt["gpt2"]
    cfg = cfg_for(path, "mode=l2l", "optim.clip=none", "model.dropout=0.0")
    data = lm_data(path)
    mb = next(TrainStream(data.train, cfg.batch.size, seed=0).batches())
    with build(cfg, data=data) as s:
        eps = s.runner.eps  # type: ignore[union-attr]
        assert [e.name for e in eps.layouts[POST].entries] == ["ln_f.weight", "ln_f.bias"]
        assert eps.ties is not None and eps.ties.numel == 2048 * 32
        total = sum(st.w.numel() for st in eps.layers)
        assert total == s.model.total_params  # type: ignore[union-attr]
        s.runner.step(mb)  # type: ignore[union-attr]
        head_part = eps.ties.g.clone()
        assert head_part.abs().sum() > 0  # the head's use of the embedding has a gradient ...
        wte = dict(eps.layers[0].layout.views(eps.layers[0].g))["wte.weight"]
        # ... and it is in the embedding's gradient: rows of tokens never seen as inputs get it only there
        seen = torch.zeros(2048, dtype=torch.bool)
        seen[mb.input_ids.flatten()] = True
        unseen_rows = (~seen).nonzero().flatten()
        torch.testing.assert_close(wte[unseen_rows], head_part.view(2048, 32)[unseen_rows])


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_cmp_trains_decoder(ckpt: dict[str, Path], kind: str) -> None:
    """CMP (bf16 device copies, FP32 master in the EPS): the loss falls on real text."""
    path = ckpt[kind]
    cfg = cfg_for(
        path, "mode=l2l", "precision=cmp", "optim.lr=1e-2", "optim.schedule=constant", "optim.warmup_steps=0"
    )
    losses = train(cfg, steps=8, total_steps=8, data=lm_data(path))["losses"]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.25, losses  # from ln(2048) = 7.62: ~-0.4..-0.6


def test_export_reloads_with_automodel_and_gives_the_runs_logits(
    ckpt: dict[str, Path], tmp_path: Path
) -> None:
    """A Llama checkpoint fine-tuned with mode=l2l; final/ loads with AutoModelForCausalLM (and its
    tokenizer with AutoTokenizer) and gives the logits of the run's own final forward."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ckpt["llama"]
    cfg = cfg_for(path, "mode=l2l", "trainer.max_steps=3", "trainer.save_final=true", "model.dropout=0.0")
    data = lm_data(path)
    batch = data.dev.collate(list(range(4)), 16)
    with build(cfg, run_dir=tmp_path, data=data) as s:
        s.trainer.run()  # type: ignore[union-attr]
        ours = s.runner.predict(batch)  # type: ignore[union-attr]
    final = tmp_path / "final"
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    with torch.no_grad():
        theirs = model(batch.input_ids).logits
    assert type(model).__name__ == "LlamaForCausalLM"
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    before = AutoModelForCausalLM.from_pretrained(path)
    assert not torch.allclose(before(batch.input_ids).logits, theirs, atol=1e-3)  # it did train
    tok = AutoTokenizer.from_pretrained(final)
    assert tok.eos_token_id == json.loads((final / "config.json").read_text())["eos_token_id"]


@pytest.mark.parametrize("kind", ["roberta", "t5"])
def test_encoder_and_seq2seq_checkpoints_refused(tmp_path: Path, kind: str) -> None:
    """A RoBERTa or T5 directory: exit 2, one line naming model.pretrained and the supported types, and
    no run (no metrics)."""
    from transformers import RobertaConfig, T5Config

    cfg = RobertaConfig() if kind == "roberta" else T5Config()
    cfg.save_pretrained(tmp_path / kind)
    (tmp_path / kind / "model.safetensors").write_bytes(b"")
    run = tmp_path / "run"
    r = l2l("train", "task=lm", f"model.pretrained={tmp_path / kind}", f"hydra.run.dir={run}")
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if "model.pretrained" in ln]
    assert len(lines) == 1, r.stdout + r.stderr
    assert f"'{kind}'" in lines[0] and "gpt2" in lines[0] and "llama" in lines[0] and "bert" in lines[0]
    assert "Traceback" not in r.stderr and not (run / "metrics.jsonl").exists()


def test_stash_cpu_device_peak_flat_in_depth_for_a_decoder() -> None:
    """GPT-2 with the stash on the host: the device tier holds two layer slots and one micro-batch's work,
    whatever the depth (as for BERT, L2L v2 Table 4)."""
    data = None
    peaks = []
    for layers in (2, 8, 32):
        cfg = tiny_cfg(
            *LM,
            "model.family=gpt2",
            f"model.num_layers={layers}",
            "model.vocab_size=2048",
            "model.seq_len=64",
            "model.layer_norm_eps=1e-5",
            "mode=l2l_stash_cpu",
            "task.pad_to_max=true",
        )
        data = data or load_task(cfg.task, cfg.model)
        peaks.append(train(cfg, steps=2, data=data)["peak"])
    assert max(peaks) <= 1.05 * min(peaks), peaks


def test_chunked_lm_loss_equals_the_whole_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    """Training takes the LM loss over chunks of positions (logits recomputed in backward): the same loss
    and gradients as over all the logits at once, ignored labels included."""
    from l2l_cli.models import decoder_modules
    from l2l_cli.models.decoder_modules import LMHead, lm_loss

    torch.manual_seed(0)
    head = LMHead("ln_f", torch.nn.LayerNorm(16), 16, 100)
    x = torch.randn(3, 10, 16, requires_grad=True)
    y = torch.randint(0, 100, (3, 10))
    y[0, 3] = -100
    ref = lm_loss(head.logits(x), y)
    ref.backward()
    grads = [x.grad.clone(), head.lm_head.weight.grad.clone()]
    x.grad = None
    head.zero_grad()
    monkeypatch.setattr(
        decoder_modules, "LOSS_CHUNK", 4 * 100
    )  # 4 positions per chunk: 7 chunks of 27 positions
    loss, logits = head(x, y)
    loss.backward()
    assert logits is None  # no logits kept in training
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(x.grad, grads[0])
    torch.testing.assert_close(head.lm_head.weight.grad, grads[1])


GPT2_TINY = [
    *LM,
    "model=gpt2-tiny",
    "model.num_layers=2",
    "model.vocab_size=2048",
]  # TINY's vocabulary is 512


@pytest.mark.parametrize("mode", ["baseline_ag", "l2l_p"])
def test_decoder_resume_is_exact(tmp_path: Path, mode: str) -> None:
    """A tied-head GPT-2 stopped after step 2 and resumed: bitwise the run that never stopped."""
    import shutil

    from l2l_cli.train import run_job
    from tests.test_checkpoint import _assert_equal_dirs

    run = [
        *GPT2_TINY,
        f"mode={mode}",
        "trainer.max_steps=4",
        "trainer.save_every=2",
        "task.max_eval_samples=8",
    ]
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert run_job(tiny_cfg(*run), full) == "ok"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step_4")
    assert run_job(tiny_cfg(*run, f"trainer.resume={cut}"), cut) == "ok"
    _assert_equal_dirs(full / "checkpoints" / "step_4", cut / "checkpoints" / "step_4")


@pytest.mark.slow
def test_decoder_two_ranks_equal_one_process_with_the_global_batch(tmp_path: Path) -> None:
    """Data parallel for a tied-head decoder: DDP (baseline_ag: the shared parameter reduced once) and the
    EPS (l2l_p: the embedding's gradient, head's use included, reduced per layer) equal one process."""

    from safetensors.torch import load_file

    from tests.util import TINY

    common = [
        "-m",
        "mode=baseline_ag,l2l_p",
        *TINY,
        *GPT2_TINY,
        "trainer.max_steps=3",
        "trainer.save_final=true",
        "task.max_eval_samples=8",
    ]
    for name, extra in (("one", ["batch.size=8"]), ("two", ["dist.nproc=2", "batch.size=4"])):
        r = l2l("train", *common, *extra, f"hydra.sweep.dir={tmp_path / name}", timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
    for job in ("0", "1"):
        a = load_file(tmp_path / "one" / job / "final" / "model.safetensors")
        b = load_file(tmp_path / "two" / job / "final" / "model.safetensors")
        assert "lm_head.weight" not in a
        assert_same_weights(a, b, rtol=1e-4)


@pytest.mark.slow  # the pipeline's own tests are the default ones
def test_an_untied_decoder_pipelines_like_one_process_and_a_tied_one_is_refused(tmp_path: Path) -> None:
    """A Llama decoder on a 2-rank modular pipeline (stages past the first take positions from the mask,
    evaluation broadcasts the LM's rows x sequence x vocabulary logits) trains as one process does; a tied
    head, whose one tensor would live on the first and the last rank, is refused before any rank starts."""

    from safetensors.torch import load_file

    common = [
        "model=llama-tiny",
        "task=lm",
        "model.num_layers=2",
        "model.hidden_size=32",
        "model.num_heads=4",
        "model.num_kv_heads=2",
        "model.intermediate_size=64",
        "model.dropout=0.0",
        "task.max_seq_len=16",
        "task.max_eval_samples=8",
        "batch.size=4",
        "batch.ubatch_size=2",
        "trainer.max_steps=2",
        "trainer.save_final=true",
        "trainer.progress=none",
        "mode=baseline_ag",
    ]
    for name, extra in (("one", []), ("pipe", ["dist.nproc=2", "dist.pipeline=2"])):
        r = l2l("train", *common, *extra, f"hydra.run.dir={tmp_path / name}", timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
    one, pipe = (json.loads((tmp_path / n / "summary.json").read_text()) for n in ("one", "pipe"))
    assert pipe["pipeline"]["pipeline"] == 2 and pipe["eval"]["loss"] == pytest.approx(
        one["eval"]["loss"], rel=1e-5
    )
    assert_same_weights(
        load_file(tmp_path / "pipe/final/model.safetensors"),
        load_file(tmp_path / "one/final/model.safetensors"),
        rtol=1e-4,
    )
    r = l2l(
        "train",
        *GPT2_TINY,
        "task=lm",
        "dist.nproc=2",
        "dist.pipeline=2",
        "mode=baseline_ag",
        f"hydra.run.dir={tmp_path / 'tied'}",
    )
    assert r.returncode == 2 and "dist.pipeline: the model's LM head is tied" in r.stderr
    assert not (tmp_path / "tied" / "summary.json").exists()


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_mistral_and_qwen2_checkpoints_load_through_the_llama_family(tmp_path: Path, kind: str) -> None:
    """Their own transformers modules (Qwen2's Q/K/V biases) and their sliding windows (shorter than the
    sequence here; Qwen2's on its upper layers only): the layered model's logits are Hugging Face's."""
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

    from l2l_cli.data.batches import Batch
    from l2l_cli.models import LayeredModel, make_spec

    sizes = dict(
        num_hidden_layers=3,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=300,
        max_position_embeddings=64,
        sliding_window=4,
    )
    if kind == "mistral":
        cfg = MistralConfig(**sizes)
    else:
        cfg = Qwen2Config(**sizes, use_sliding_window=True, max_window_layers=1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    spec = make_spec(cfg_for(tmp_path).model, 0)
    assert (spec.family, spec.model_type) == ("llama", kind)  # type: ignore[attr-defined]
    model = LayeredModel(spec).eval()
    from safetensors.torch import load_file

    assert model.load_hf_state_dict(load_file(tmp_path / "model.safetensors")) == []
    ids = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        _, ours = model(Batch(ids, torch.zeros_like(ids), torch.ones_like(ids), ids))
        ref = theirs(ids).logits
        full = {"sliding_window": None} if kind == "mistral" else {"layer_types": ["full_attention"] * 3}
        unwindowed = AutoModelForCausalLM.from_pretrained(tmp_path, **full).eval()(ids, use_cache=False)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(ours, unwindowed.logits, atol=1e-3)  # the window matters at 16 > 4 tokens


def test_sharded_checkpoint_loads_and_an_escaping_shard_is_refused(tmp_path: Path) -> None:
    """A checkpoint saved in shards (as 7B-and-larger ones are) streams in shard by shard; an index naming
    a file outside the checkpoint's folder is refused."""
    from transformers import AutoModelForCausalLM

    from l2l_cli.problems import ConfigError

    path = write_checkpoint("llama", tmp_path)
    model = AutoModelForCausalLM.from_pretrained(path)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    (path / "tokenizer.json").replace(sharded / "tokenizer.json")
    (path / "tokenizer_config.json").replace(sharded / "tokenizer_config.json")
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    cfg = cfg_for(sharded, "mode=l2l")
    with build(cfg, data=lm_data(sharded)) as s:
        ours = dict(s.runner.hf_tensors())  # type: ignore[union-attr]
    theirs = model.state_dict()
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k
    index = sharded / "model.safetensors.index.json"
    meta = json.loads(index.read_text())
    meta["weight_map"]["lm_head.weight"] = "../evil.safetensors"
    index.write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=r"model\.pretrained: .*not a file name in that folder"):
        build(cfg, data=lm_data(sharded))  # bad input: exit 2 naming the key
