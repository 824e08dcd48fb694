"""LayeredModel is BERT: same logits as BertForSequenceClassification; HF checkpoints in and out."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import BertForSequenceClassification

from l2l_cli.config import ModelConfig
from l2l_cli.data.batches import Batch
from l2l_cli.models import FAMILIES, LayeredModel
from l2l_cli.models.hf import SafeTensors
from tests.util import batches, bert_spec, built, tiny_cfg


def _batch(n_labels: int) -> Batch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 500, (4, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[3, 3:] = 0
    labels = torch.randn(4) if n_labels == 1 else torch.randint(0, n_labels, (4,), generator=g)
    return Batch(ids, torch.randint(0, 2, (4, 12), generator=g), mask, labels)


@pytest.mark.parametrize("num_labels", [1, 2, 3])
def test_layered_model_logits_equal_hf(num_labels: int) -> None:
    spec = bert_spec(2, 64, 4, 128, num_labels=num_labels, vocab_size=512, seq_len=64)
    model = LayeredModel(spec, seed=3).eval()
    hf = BertForSequenceClassification(spec.hf_config()).eval()
    assert hf.load_state_dict(model.hf_state_dict(), strict=True)
    b = _batch(num_labels)
    loss, logits = model(b)
    ref = hf(
        input_ids=b.input_ids,
        attention_mask=b.attention_mask,
        token_type_ids=b.token_type_ids,
        labels=b.labels,
    )
    torch.testing.assert_close(logits, ref.logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref.loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["baseline_ag", "l2l"])
def test_save_final_round_trips_through_from_pretrained(tmp_path, mode: str) -> None:
    cfg = tiny_cfg(f"mode={mode}")
    with built(cfg) as runner:
        runner.step(next(batches(cfg)))
        runner.spec.save_hf(tmp_path, runner.hf_tensors())
        probe = next(batches(cfg, seed=9))
        ours = runner.predict(probe)
    hf = BertForSequenceClassification.from_pretrained(tmp_path).eval()
    ref = hf(
        input_ids=probe.input_ids, attention_mask=probe.attention_mask, token_type_ids=probe.token_type_ids
    ).logits
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_pretrained_minilm_loads_into_every_mode(minilm) -> None:
    spec = FAMILIES["bert"].from_hf_dir(Path(minilm), ModelConfig(dropout=0.0), 2)
    assert (spec.num_layers, spec.hidden_size, spec.num_heads) == (6, 384, 12)
    hf = BertForSequenceClassification.from_pretrained(minilm, num_labels=2).eval()
    with safe_open(f"{minilm}/model.safetensors", framework="pt") as f:
        model = LayeredModel(spec)
        missing = model.load_hf_state_dict(SafeTensors(f))
    assert sorted(missing) == ["classifier.bias", "classifier.weight"]
    model.post.classifier.load_state_dict(hf.classifier.state_dict())
    b = _batch(2)
    ref = hf(input_ids=b.input_ids, attention_mask=b.attention_mask, token_type_ids=b.token_type_ids).logits
    torch.testing.assert_close(model.eval()(b)[1], ref, rtol=1e-4, atol=1e-5)
