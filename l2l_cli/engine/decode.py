"""Generation layer by layer (``l2l generate`` of a model that does not fit, or ``--layered``): the same
inverted loop as training's forward pass. For the prompts' prefill and then for each new token, layer l is
brought to the device through the relay, run for every sequence with layer l's key/value cache, and
released before layer l+1; so only the executing layer (and the next, prefetched) is on the device, and a
model that trains with L2L also samples with L2L.

Each block's cache lives off the device between its uses: in host RAM (:class:`HostKV`), or in one
memory-mapped file per layer beside a disk EPS (:class:`DiskKV`), and only the new positions are written
back after each use. Sampling is ``transformers``' own: the same logits warpers (temperature, then top-p),
softmax and ``torch.multinomial``, one seeded generator per prompt, so on the CPU the two engines draw the
same tokens from the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from l2l_cli.engine.device import Accelerator
from l2l_cli.engine.eps import EagerParamServer
from l2l_cli.engine.precision import Precision
from l2l_cli.engine.relay import Relay
from l2l_cli.models.decoder import DecoderSide, DecoderSpec


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked: greedy (``temperature`` 0) or sampled (temperature, nucleus top-p),
    with prompt i's draws from a generator seeded ``seed + i`` (reproducible, and the same in both
    engines)."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def warpers(self) -> list[Any]:
        """``transformers``' logits warpers, in the order ``generate`` applies them."""
        from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

        out: list[Any] = []
        if not self.greedy and self.temperature != 1.0:
            out.append(TemperatureLogitsWarper(self.temperature))
        if not self.greedy and self.top_p < 1.0:
            out.append(TopPLogitsWarper(self.top_p))
        return out

    def hf_kwargs(self) -> dict[str, Any]:
        """The same choice as ``transformers.GenerationConfig`` fields (top-k 0: off; unset, generate
        would keep the top 50)."""
        if self.greedy:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": 0}

    def pick(
        self, logits_BV: torch.Tensor, ids_BS: torch.Tensor, gens: list[torch.Generator]
    ) -> torch.Tensor:
        """The next token of each row, from its last position's logits (FP32 on the CPU, as generate)."""
        scores = logits_BV.to("cpu", torch.float32)
        for w in self.warpers():
            scores = w(ids_BS, scores)
        if self.greedy:
            return scores.argmax(dim=-1)
        probs = torch.softmax(scores, dim=-1)
        return torch.cat(
            [torch.multinomial(probs[b : b + 1], 1, generator=g)[:, 0] for b, g in enumerate(gens)]
        )


class LayerCache:
    """One block's keys and values as ``transformers``' attention expects of a cache (``update`` appends
    the new positions and returns the whole), for one forward of that block."""

    def __init__(self, keys: torch.Tensor | None, values: torch.Tensor | None):
        self.keys, self.values = keys, values
        self.past = 0 if keys is None else keys.shape[-2]

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int = 0, *args: Any, **kw: Any) -> Any:
        if self.keys is not None and self.values is not None:
            k, v = torch.cat([self.keys, k], dim=-2), torch.cat([self.values, v], dim=-2)
        self.keys, self.values = k, v
        return k, v


class KVStore(Protocol):
    """Where the blocks' caches wait between uses."""

    def load(self, i: int, device: torch.device) -> LayerCache: ...

    def save(self, i: int, cache: LayerCache) -> None: ...


class HostKV:
    """Each block's keys and values in host RAM, ``[B, heads, capacity, head_dim]``, allocated at the
    first save (their shape is the family's); only the positions a forward added are copied back."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.length: dict[int, int] = {}

    def _alloc(self, i: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, _, d = like.shape
        return (
            torch.empty(b, h, self.capacity, d, dtype=like.dtype),
            torch.empty(b, h, self.capacity, d, dtype=like.dtype),
        )

    def load(self, i: int, device: torch.device) -> LayerCache:
        n = self.length.get(i, 0)
        if not n:
            return LayerCache(None, None)
        k, v = self.kv[i]
        return LayerCache(k[:, :, :n].to(device), v[:, :, :n].to(device))

    def save(self, i: int, cache: LayerCache) -> None:
        assert cache.keys is not None and cache.values is not None
        if i not in self.kv:
            self.kv[i] = self._alloc(i, cache.keys)
        k, v = self.kv[i]
        start, end = cache.past, cache.keys.shape[-2]
        k[:, :, start:end].copy_(cache.keys[:, :, start:end])
        v[:, :, start:end].copy_(cache.values[:, :, start:end])
        self.length[i] = end


class DiskKV(HostKV):
    """The caches in files (``kv_<layer>.bin`` under ``folder``), memory-mapped: the disk tier's runs keep
    them on disk beside the layers, and the page cache keeps what RAM allows."""

    def __init__(self, capacity: int, folder: Path):
        super().__init__(capacity)
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def _alloc(self, i: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, _, d = like.shape
        n = b * h * self.capacity * d
        path = self.folder / f"kv_{i}.bin"
        flat = torch.from_file(str(path), shared=True, size=2 * n, dtype=like.dtype)
        return flat[:n].view(b, h, self.capacity, d), flat[n:].view(b, h, self.capacity, d)

    def files(self) -> list[Path]:
        return sorted(self.folder.glob("kv_*.bin"))


@dataclass
class Generated:
    """One prompt's new tokens (an end-of-sequence token, if one came, included) and why it stopped."""

    tokens: list[int]
    stop: str  # "eos" (an end-of-sequence or end-of-turn id) | "length" | "stop" (a --stop text)


class LayeredDecoder:
    """Generation through an EPS and its relay (see the module docstring)."""

    def __init__(
        self, spec: DecoderSpec, eps: EagerParamServer, relay: Relay, acc: Accelerator, precision: Precision
    ):
        self.spec, self.eps, self.relay, self.acc, self.precision = spec, eps, relay, acc, precision
        self.head = spec.num_layers + 1

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        sampling: Sampling,
        eos: set[int],
        pad_id: int,
        limits: list[int],
        kv: KVStore,
    ) -> list[Generated]:
        """New tokens for every prompt (at most ``limits[i]`` for prompt i), all prompts together:
        left-padded into one batch, each layer loaded once per position for all of them."""
        dev = self.acc.device
        b, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((b, width), pad_id, dtype=torch.long)
        valid = torch.zeros((b, width), dtype=torch.bool)
        for r, p in enumerate(prompts):
            ids[r, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            valid[r, width - len(p) :] = True
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
        gens = [torch.Generator().manual_seed(sampling.seed + r) for r in range(b)]
        out: list[list[int]] = [[] for _ in range(b)]
        done = [limit <= 0 for limit in limits]
        seq = ids.clone()  # what each row holds so far (the warpers may read it)
        new_ids, new_pos = ids, positions
        self.eps.worker.wait_all()  # every background update is in before the weights are read
        self.relay.train(False)
        try:
            while not all(done):
                try:
                    logits = self._forward(new_ids.to(dev), new_pos.to(dev), valid.to(dev), kv)
                finally:  # generation's I/O and phases are no training step's
                    self.eps.tier.pop_step(self.relay.timer, training=False)
                    self.relay.timer.pop()
                nxt = sampling.pick(logits, seq, gens)
                for r in range(b):
                    if done[r]:
                        nxt[r] = pad_id
                        continue
                    out[r].append(int(nxt[r]))
                    done[r] = int(nxt[r]) in eos or len(out[r]) >= limits[r]
                seq = torch.cat([seq, nxt[:, None]], dim=1)
                # a finished row stops advancing (its padding stays at its last position): a long prompt
                # that finished early never reaches past the model's positions (GPT-2's learned ``wpe``)
                going = torch.tensor([not d for d in done], dtype=torch.long)[:, None]
                new_ids, new_pos = nxt[:, None], new_pos[:, -1:] + going
                valid = torch.cat([valid, torch.ones(b, 1, dtype=torch.bool)], dim=1)
        finally:
            self.relay.train(True)
        return [Generated(t, "eos" if t and t[-1] in eos else "length") for t in out]

    def _forward(
        self, ids_BQ: torch.Tensor, pos_BQ: torch.Tensor, valid_BK: torch.Tensor, kv: KVStore
    ) -> torch.Tensor:
        """Logits of the last new position: every layer in turn, each block with its cache."""
        spec, dtype = self.spec, self.precision.device_dtype
        side = self._side(pos_BQ, valid_BK, dtype)
        layer = self.relay.acquire(0, prefetch=1)
        with self.precision.autocast():
            x = spec.embed_at(layer, ids_BQ, pos_BQ)
        for i in range(1, self.head):
            layer = self.relay.acquire(i, prefetch=i + 1)
            cache = kv.load(i, self.acc.device)
            with self.precision.autocast():
                x = spec.run_block(layer, i, x, replace(side, cache=cache))
            kv.save(i, cache)
        layer = self.relay.acquire(self.head, prefetch=0)
        with self.precision.autocast():
            return spec.head_logits(layer, x[:, -1:])[:, -1]

    def _side(self, pos_BQ: torch.Tensor, valid_BK: torch.Tensor, dtype: torch.dtype) -> DecoderSide:
        """The masks of the new positions (queries) against every key so far, and their rotary angles.
        Without padding and window the masks are None (SDPA's causal kernel, as ``generate`` runs a single
        prompt); a padded query may see itself, so no row of the mask is empty."""
        q_len, k_len = pos_BQ.shape[1], valid_BK.shape[1]
        window = self.spec.sliding_window()
        padded = not bool(valid_BK.all())
        q = torch.arange(k_len - q_len, k_len, device=valid_BK.device)[:, None]
        k = torch.arange(k_len, device=valid_BK.device)[None, :]
        causal = (k <= q)[None, None] & (valid_BK[:, None, None, :] | (k == q)[None, None])

        def mask(win: int | None) -> torch.Tensor | None:
            if win is None and not padded:
                return None
            return causal & (k > q - win)[None, None] if win is not None else causal

        return DecoderSide(
            mask=mask(None),
            window_mask=mask(window) if window is not None and window < k_len else None,
            rope=self.spec.rope_at(pos_BQ, dtype),
        )
