"""Write what the README's decoder fine-tuning walk-through needs, offline: a tiny chat dataset
(``chat.jsonl``: rows of ``messages``; ``sharegpt.jsonl``: the same conversations as ShareGPT rows of
``conversations`` with ``from``/``value``) and a tiny random Llama with a word-level tokenizer that carries a
ChatML chat template (``model/``). A real run names a real checkpoint instead (``model.pretrained=...``).

    python examples/make_tiny_chat.py /tmp/chat-demo
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
COLOURS = {
    "sky": "blue",
    "grass": "green",
    "sun": "yellow",
    "night": "dark",
    "snow": "white",
    "coal": "black",
}
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def conversations(n: int, seed: int = 0) -> list[dict]:
    """Questions with one right answer (a colour, a sum), sometimes with a system turn."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2:
            thing = rng.choice(list(COLOURS))
            q, a = f"what colour is the {thing} ?", f"the {thing} is {COLOURS[thing]} ."
        else:
            x, y = rng.randint(0, 5), rng.randint(0, 5)
            q, a = (
                f"what is {NUMBERS[x]} plus {NUMBERS[y]} ?",
                f"{NUMBERS[x]} plus {NUMBERS[y]} is {NUMBERS[x + y]} .",
            )
        msgs = [{"role": "system", "content": "you are a helpful assistant ."}] if i % 3 == 0 else []
        out.append({"messages": [*msgs, {"role": "user", "content": q}, {"role": "assistant", "content": a}]})
    return out


def main(out: Path, hidden: int = 64, layers: int = 4, n: int = 256) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    rows = conversations(n)
    (out / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    speaker = {"system": "system", "user": "human", "assistant": "gpt"}
    share = [{"conversations": [{"from": speaker[m["role"]], "value": m["content"]} for m in r["messages"]]}
             for r in rows]  # fmt: skip
    (out / "sharegpt.jsonl").write_text("".join(json.dumps(r) + "\n" for r in share))
    text = [m["content"] for r in rows for m in r["messages"]] + ["system user assistant"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["<pad>", "<unk>", "<s>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(text, trainers.WordLevelTrainer(special_tokens=special))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                   eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"])  # fmt: skip
    fast.chat_template = CHATML
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=2 * hidden, vocab_size=128, max_position_embeddings=128, tie_word_embeddings=True,
                      bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(out / "model")
    fast.save_pretrained(out / "model")
    print(
        f"wrote {out / 'chat.jsonl'}, {out / 'sharegpt.jsonl'} ({len(rows)} conversations) and {out / 'model'} (a tiny Llama)"
    )


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "chat-demo"))
