"""Write the bundled language-modelling corpus and its tokenizer (``l2l_cli/data/corpus/``).

The corpus is text already on this machine: the premises (``sentence1``) of GLUE RTE's train split,
deduplicated, one document per paragraph. The tokenizer is a byte-level BPE (GPT-2's scheme: every byte
sequence encodes, nothing is unknown) of 2048 ids trained on that corpus with the ``tokenizers`` library,
with ``<|endoftext|>`` as its end-of-document token. Both are small (≈0.6 MB, ≈0.1 MB) and make
``l2l train task=lm model=gpt2-tiny`` work offline; the hub's GPT-2/Llama tokenizers are not reachable here.

    python scripts/make_lm_corpus.py --glue ../shared/data/glue      # rewrites the bundled files
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "l2l_cli" / "data" / "corpus"
EOS = "<|endoftext|>"
VOCAB = 2048


def premises(glue: Path) -> list[str]:
    """RTE train's premises, in file order, without repeats (the TSVs are read with quoting off)."""
    with (glue / "RTE" / "train.tsv").open(encoding="utf-8", newline="") as f:
        rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(rows)
        col = header.index("sentence1")
        texts = [" ".join(r[col].split()) for r in rows if len(r) > col]
    return [t for t in dict.fromkeys(texts) if t]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--glue", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/glue")
    args = ap.parse_args()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    docs = premises(args.glue)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "rte_premises.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS)
    fast.model_max_length = 1 << 30
    fast.save_pretrained(str(OUT / "tokenizer"))
    print(
        f"{len(docs)} documents -> {OUT / 'rte_premises.txt'}; tokenizer ({len(fast)} ids) -> "
        f"{OUT / 'tokenizer'}"
    )


if __name__ == "__main__":
    main()
