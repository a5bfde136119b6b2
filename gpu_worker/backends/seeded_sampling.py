"""Per-request seeded sampling inside transformers' continuous batching, by the Gumbel-max trick.

transformers' manager (5.25) applies per-request temperature and top_p, then samples every row of a step with one
``torch.multinomial`` on a global generator: a request's tokens depend on what else ran beside it, and a
``seed`` is refused. Here the manager decodes greedily (argmax) and one more logits processor, last in line,
adds Gumbel noise to each sampled row's scores: argmax(logits / T, top_p applied, + Gumbel) is a draw from
softmax(logits / T) after top_p. The noise is not drawn from a generator but hashed from the row's key
(its request's seed and the position of the token being chosen) and each token's id, so it is the same
whatever batch the request runs in, on any device, and needs no per-row generator or launch (a graph-friendly
few elementwise ops over [rows, vocab]). Greedy rows get key -1: no noise, plain argmax.

The hash is 32-bit integer mixing (the "lowbias" multiply-xorshift) done in int64 with every product below
2**63; its uniformity is checked statistically in ``tests/test_seeded_sampling.py``.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor

M32 = 0xFFFFFFFF
MIX = 0x45D9F3B  # below 2**27: a product with a 32-bit value stays below 2**59
GOLDEN = 0x9E3779B1
NO_NOISE = -1  # a greedy row's key


def mix32(x: int) -> int:
    """A 32-bit integer hash (the same as :func:`_mix`, on Python ints)."""
    x &= M32
    x ^= x >> 16
    x = (x * MIX) & M32
    x ^= x >> 16
    x = (x * MIX) & M32
    return x ^ (x >> 16)


M64 = 0xFFFFFFFFFFFFFFFF


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def draw_key(seed: int, step: int) -> int:
    """The noise key of a request's ``step``-th generated token: 31 bits of a 64-bit hash of its seed (any int,
    taken modulo 2**64) and the step, so that two seeds' keys are unrelated at every step."""
    return _splitmix64(_splitmix64(seed & M64) ^ (step & M64)) & 0x7FFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * MIX) & M32
    x = x ^ (x >> 16)
    x = (x * MIX) & M32
    return x ^ (x >> 16)


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise of shape [rows, vocab], a pure function of each row's key and each token's id."""
    k = keys.to(torch.int64).unsqueeze(-1)  # [B, 1]
    ids = torch.arange(vocab, dtype=torch.int64, device=keys.device).unsqueeze(0)  # [1, V]
    h = _mix(((ids * GOLDEN) & M32) ^ k)
    h = _mix(h ^ ((k * MIX) & M32))
    # 23 bits: (k + 0.5) / 2**23 is exact in float32, so u stays inside (0, 1) (24 bits would round the top
    # value up to 1.0: infinite noise, a token drawn whatever its logit)
    u = ((h >> 9).to(torch.float32) + 0.5) / float(1 << 23)
    return -torch.log(-torch.log(u))


class SeededGumbel(ContinuousBatchingLogitsProcessor):
    """The last logits processor of a greedy manager: noise on each sampled row, keyed by its request's ``seed``
    (a ``logit_processor_kwargs`` of ``add_request``; absent or negative: greedy) and its token's position."""

    supported_kwargs: dict[str, type] = {"seed": int}  # noqa: RUF012 (transformers declares it so)
    ignored_kwargs: tuple[str, ...] = ()

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(NO_NOISE)

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        keys = []
        for future in requests_with_new_token:
            state = future.state
            seed = state.logit_processor_kwargs.get("seed", NO_NOISE)
            if seed < 0:
                keys.append(NO_NOISE)
                continue
            # the position of the token being chosen: the KV length after this pass (already advanced), less the
            # request's own prompt (a request reset after preemption carries its generated tokens as prompt)
            prompt = state._true_initial_tokens or len(state.initial_tokens)
            keys.append(draw_key(seed, state.position_offset - prompt))
        return torch.tensor(keys, dtype=torch.int32, device="cpu")

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        keys = tensor_arg[: scores.size(0)]
        noisy = scores + gumbel_noise(keys.clamp(min=0), scores.size(-1))
        return torch.where((keys >= 0).unsqueeze(-1), noisy, scores)
