"""Captions drawn from the model, for self-critical training: `sample` draws each word from the
decoder's distribution with the masking beam search applies (`search.ban`: banned ids never, no
<end> before `min_length` words), so the log-probabilities SCST trains on are those of what it drew.

Shapes: B images, n samples per image, R = B·n rows, L regions, T words drawn, V vocabulary.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from captioner.decoding.rules import ban
from captioner.model.decoder import AttentionDecoder


@torch.no_grad()
def sample(decoder: AttentionDecoder, features: Tensor, n: int, max_length: int, start_id: int, end_id: int,
           pad_id: int, banned_ids: Sequence[int] = (), min_length: int = 1,
           generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """`n` captions per image drawn from the model (multinomial, temperature 1), with the masking
    and length limits decoding uses: banned ids never drawn, no <end> before `min_length` words,
    at most `max_length` words (a caption cut there has no <end>).

    Args:
        decoder: in the mode whose distribution is wanted (eval: no dropout).
        features: (B, L, D) encoder grids.
        n: captions per image; rows b·n .. b·n + n - 1 are image b's.
    Returns:
        tokens (B·n, T) word ids, then <end> where drawn, then <pad>; lengths (B·n,) the scored
        positions of each (its words, plus <end> when drawn), at least 1.
    """
    B = features.size(0)
    R = B * n
    memory = decoder.memory(features)  # (B, L, D), (B, L, A): once per image
    state = decoder.init_hidden(memory).repeat_interleave(n, dim=0)  # (R, H) or (R, H + D)
    memory = memory.expand(n)  # each image's read by its n rows
    token = torch.full((R,), start_id, dtype=torch.long, device=features.device)  # (R,)
    alive = torch.ones(R, dtype=torch.bool, device=features.device)  # (R,) not ended yet
    banned = torch.tensor(list(banned_ids), dtype=torch.long, device=features.device)
    drawn = []
    for t in range(max_length):  # a caption still going after max_length words is cut (no <end>)
        out = decoder.step(token, state, memory)  # logits (R, V), hidden (R, ...)
        logp = ban(torch.log_softmax(out.logits.float(), dim=-1), banned, end_id, t < min_length)  # (R, V)
        token = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)  # (R,)
        token = torch.where(alive, token, torch.full_like(token, pad_id))
        drawn.append(token)
        alive &= token != end_id
        state = out.hidden
        if not bool(alive.any()):
            break
    tokens = torch.stack(drawn, dim=1)  # (R, T)
    return tokens, (tokens != pad_id).sum(dim=1)
