"""Token sampler: one row of logits per sequence in, one token (and logprobs) per row out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Sequence

import torch

from pdserve.engine.logits_processors import TokenHistory, adjust_logits_
from pdserve.engine.types.sampling_params import SamplingParams

# Row maxima are taken over chunks of this many entries first (first_argmax).
_ARGMAX_CHUNK = 256


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D tensor, the same index (the first maximum; the first NaN where a row has
    one) found faster on CPU: torch's CPU argmax is a scalar loop (0.7-1.2 ms over 32 x 49,152 float32 on two
    cores, where ``amax`` takes 0.04 ms), so each row's maximum is first located among chunk maxima
    (``amax``), then within its chunk. Other devices and short rows use torch's argmax."""
    rows, width = x.shape
    if x.device.type != "cpu" or width < 16 * _ARGMAX_CHUNK or not x.is_contiguous():
        return x.argmax(dim=-1)
    full = width - width % _ARGMAX_CHUNK
    chunk_maxima = x[:, :full].view(rows, full // _ARGMAX_CHUNK, _ARGMAX_CHUNK).amax(dim=-1)
    if full < width:
        chunk_maxima = torch.cat([chunk_maxima, x[:, full:].amax(dim=-1, keepdim=True)], dim=1)
    # The first chunk holding the row's maximum (amax keeps a NaN, which argmax ranks first), then its first
    # maximum; a short last chunk's columns past the row end repeat its last one, which cannot come first.
    starts = chunk_maxima.argmax(dim=-1) * _ARGMAX_CHUNK  # (rows,)
    columns = (starts[:, None] + torch.arange(_ARGMAX_CHUNK, device=x.device)).clamp_(max=width - 1)
    within = x.gather(1, columns).argmax(dim=-1, keepdim=True)
    return columns.gather(1, within).squeeze(1)


@dataclass(frozen=True)
class SamplerOutput:
    """What the sampler decided for one step, one row per sequence, on the logits' device.

    ``logprobs`` and the ``top_*`` tensors come from the raw model distribution
    (``log_softmax`` of the untempered, unfiltered logits), as vLLM returns them.
    ``top_token_ids[i, :n]`` with ``n = params[i].logprobs`` are row ``i``'s
    ``n`` most likely tokens in descending logprob order; the rest of the row is
    padding for requests that asked for fewer than the batch maximum.
    """

    token_ids: torch.Tensor  # (num_seqs,) int64
    logprobs: torch.Tensor | None  # (num_seqs,) float32; None when no row asked for logprobs
    top_token_ids: torch.Tensor | None  # (num_seqs, max_n) int64; None when max_n == 0
    top_logprobs: torch.Tensor | None  # (num_seqs, max_n) float32; None when max_n == 0


class Sampler:
    """Samples the next token of every row in a batch with per-row parameters.

    Rows whose parameters adjust logits (min_tokens, logit_bias, penalties: see
    ``engine.logits_processors``) have them adjusted first; the others are left
    bit for bit as the model produced them, at no cost. Greedy rows
    (``temperature == 0``) then take the argmax and draw no randomness. Every
    other row is tempered, filtered by top-k then top-p, and sampled with the
    exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` per
    vocabulary entry, which picks token ``i`` with probability ``p_i``.

    Randomness: each sampled row draws exactly one vector of ``vocab_size``
    exponentials per step, from ``generators[i]`` when it is given, otherwise
    from the sampler's own generator (seeded by ``seed``). A row with its own
    generator therefore gets tokens that depend only on its generator's state
    and its own logits, never on the other rows of the batch. Greedy rows leave
    their generator untouched.
    """

    def __init__(self, seed: int | None = None, eos_token_ids: Collection[int] = ()) -> None:
        # What min_tokens masks besides a row's stop_token_ids (unless it ignores EOS).
        self.eos_token_ids = frozenset(eos_token_ids)
        self._generator = torch.Generator(device="cpu")
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        # Unseeded rows on an accelerator draw their noise there, so that the
        # whole (rows, vocab) noise block never crosses the bus. Those device
        # generators are seeded from the CPU one to keep `seed` meaningful.
        self._device_generators: dict[torch.device, torch.Generator] = {}

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        histories: Sequence[TokenHistory | None] | None = None,
    ) -> SamplerOutput:
        """``histories[i]``: row ``i``'s tokens, needed (only) by rows whose parameters adjust logits.

        Those rows are adjusted in place: a float32 ``logits`` is changed (the
        model runner's is a temporary).
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be (num_seqs, vocab_size), got shape {tuple(logits.shape)}")
        num_seqs, vocab_size = logits.shape
        if len(params) != num_seqs or len(generators) != num_seqs:
            raise ValueError(
                f"need one SamplingParams and one generator per row: {num_seqs} rows, "
                f"{len(params)} params, {len(generators)} generators"
            )
        device = logits.device
        # bf16 model outputs are upcast once here. Even a plain greedy batch pays the copy: torch's argmax
        # over bfloat16 rows is ~5x slower on CPU than the upcast and a float32 argmax together
        # (5.9 against 1.3 ms at 32 x 49,152, one thread).
        logits = logits.float()  # (num_seqs, vocab_size)
        # vLLM's default: logprobs of the raw model distribution, before any
        # adjustment, temperature or filtering, so they do not depend on how we sampled.
        wants_logprobs = any(p.logprobs is not None for p in params)
        all_logprobs = torch.log_softmax(logits, dim=-1) if wants_logprobs else None  # (num_seqs, vocab_size)
        adjust_logits_(logits, params, histories, self.eos_token_ids)

        token_ids = first_argmax(logits)  # (num_seqs,) greedy choice, overwritten for sampled rows
        sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, dtype=torch.long, device=device)
            token_ids[rows] = self._sample(
                logits.index_select(0, rows),
                [params[i] for i in sampled_rows],
                [generators[i] for i in sampled_rows],
            )

        return self._with_logprobs(all_logprobs, token_ids, params)

    def _sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:
        """Token ids (num_rows,) for non-greedy rows: temper, filter, then race."""
        num_rows, vocab_size = logits.shape
        device = logits.device
        temperatures = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        scaled = logits / temperatures.unsqueeze(1)  # (num_rows, vocab_size)

        keep = self._top_k_top_p_mask(scaled, params)  # (num_rows, vocab_size) bool, or None

        # Unnormalised probabilities: the race's argmax is unchanged by the
        # per-row normaliser, and leaving it out keeps a row's scores bitwise
        # identical whether or not another row made the batch take the sort path.
        weights = torch.exp(scaled - scaled.amax(dim=-1, keepdim=True))  # (num_rows, vocab_size)
        if keep is not None:
            weights = weights.masked_fill(~keep, 0.0)
        noise = self._exponential_noise(generators, num_rows, vocab_size, device)
        return first_argmax(weights / noise)

    @staticmethod
    def _top_k_top_p_mask(scaled: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor | None:
        """Boolean mask of the tokens each row may draw, or None when no row filters."""
        num_rows, vocab_size = scaled.shape
        device = scaled.device
        top_ks = [vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params]
        top_ps = [p.top_p for p in params]
        # Sorting a large vocabulary dominates the sampler's cost; skip it when
        # the batch has nothing to filter.
        if all(k == vocab_size for k in top_ks) and all(p >= 1.0 for p in top_ps):
            return None
        top_k = torch.tensor(top_ks, dtype=torch.long, device=device)
        top_p = torch.tensor(top_ps, dtype=torch.float32, device=device)

        # Stable sort so that ties at the top-k boundary keep the lowest token id.
        sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)  # (num_rows, vocab_size)
        ranks = torch.arange(vocab_size, device=device).unsqueeze(0)  # (1, vocab_size)
        drop = ranks >= top_k.unsqueeze(1)  # (num_rows, vocab_size), in sorted order

        # Nucleus on the tempered, top-k-filtered distribution. A token is kept
        # while the mass strictly before it is still below top_p, so the token
        # that crosses the threshold stays and the top token always stays
        # (the mass before it is exactly 0 < top_p).
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Shifted cumsum rather than cumsum - probs: the subtraction's rounding
        # could move a token across the threshold.
        cumulative = sorted_probs.cumsum(dim=-1)  # (num_rows, vocab_size)
        mass_before = torch.nn.functional.pad(cumulative[:, :-1], (1, 0), value=0.0)
        # top_p == 1 must keep every token, even when float cumsum reaches 1 early.
        nucleus_drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        # The top token always stays, also when a tiny top_p rounds to 0 in float32.
        nucleus_drop[:, 0] = False
        drop |= nucleus_drop

        keep = torch.empty_like(drop)
        keep.scatter_(dim=-1, index=sorted_ids, src=~drop)  # back to vocabulary order
        return keep

    def _exponential_noise(
        self,
        generators: Sequence[torch.Generator | None],
        num_rows: int,
        vocab_size: int,
        device: torch.device,
    ) -> torch.Tensor:
        """Exp(1) noise (num_rows, vocab_size); row i from generators[i], or the sampler's own."""
        noise = torch.empty((num_rows, vocab_size), dtype=torch.float32, device=device)
        shared_rows = [i for i, g in enumerate(generators) if g is None]
        if shared_rows:
            shared = torch.empty((len(shared_rows), vocab_size), dtype=torch.float32, device=device)
            shared.exponential_(generator=self._generator_for(device))
            noise[torch.tensor(shared_rows, dtype=torch.long, device=device)] = shared
        for i, generator in enumerate(generators):
            if generator is None:
                continue
            # Drawn on the generator's own device, so the values depend only on
            # its state; copied across when that is not the logits' device.
            row = torch.empty(vocab_size, dtype=torch.float32, device=generator.device)
            noise[i] = row.exponential_(generator=generator)
        # Exponential draws of exactly 0 have been seen from some backends; one
        # would turn a filtered token's 0 / 0 into NaN, which argmax would pick.
        return noise.clamp_(min=torch.finfo(torch.float32).tiny)

    def _generator_for(self, device: torch.device) -> torch.Generator:
        if device.type == "cpu":
            return self._generator
        generator = self._device_generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            seed = int(torch.randint(0, 2**62, (1,), generator=self._generator).item())
            generator.manual_seed(seed)
            self._device_generators[device] = generator
        return generator

    @staticmethod
    def _with_logprobs(
        all_logprobs: torch.Tensor | None, token_ids: torch.Tensor, params: Sequence[SamplingParams]
    ) -> SamplerOutput:
        if all_logprobs is None:
            return SamplerOutput(token_ids=token_ids, logprobs=None, top_token_ids=None, top_logprobs=None)
        requested = [p.logprobs for p in params if p.logprobs is not None]
        sampled_logprobs = all_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)  # (num_seqs,)
        max_n = min(max(requested), all_logprobs.shape[1])
        if max_n == 0:
            return SamplerOutput(token_ids=token_ids, logprobs=sampled_logprobs, top_token_ids=None, top_logprobs=None)
        top_logprobs, top_token_ids = all_logprobs.topk(max_n, dim=-1, sorted=True)  # (num_seqs, max_n)
        return SamplerOutput(
            token_ids=token_ids,
            logprobs=sampled_logprobs,
            top_token_ids=top_token_ids,
            top_logprobs=top_logprobs,
        )
