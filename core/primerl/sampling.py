"""Token sampling and log-probabilities, shared by the inference engine and the trainer.

RL's importance ratio compares the trainer's log-probability of a sampled token with the
one the inference engine reported. Both sides must mean the same thing by it, so both
call :func:`token_logprobs`: ``log_softmax(logits / T)`` at the sampled token, in
float32, with temperature ``T`` (``T = 0``, greedy, is scored at ``T = 1``). Top-k and
top-p only restrict *which* tokens may be drawn; they do not renormalise the reported
log-probability, because the trainer cannot reproduce truncation from the logits alone
and would see a mismatch on every token.
"""

from __future__ import annotations

import torch

__all__ = ["sample", "scale", "token_logprobs"]


def scale(logits: torch.Tensor, temperature: torch.Tensor | float) -> torch.Tensor:
    """logits [..., V] / T in float32; T == 0 counts as 1 (greedy is scored unscaled)."""
    t = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device)
    t = torch.where(t > 0, t, torch.ones_like(t))
    if t.dim() > 0 and t.dim() == logits.dim() - 1:
        t = t.unsqueeze(-1)  # one temperature per position: [..., 1] against [..., V]
    return logits.float() / t


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: torch.Tensor | float) -> torch.Tensor:
    """log p(token) under softmax(logits / T). logits [..., V], tokens [...] -> [...]."""
    logp = torch.log_softmax(scale(logits, temperature), dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def sample(
    logits: torch.Tensor,  # [B, V]
    temperature: torch.Tensor,  # [B] float, 0 = greedy
    top_k: torch.Tensor,  # [B] int, <= 0 = off
    top_p: torch.Tensor,  # [B] float, 1 = off
    generators: list[torch.Generator | None],  # per row: seeded requests are reproducible
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw one token per row.

    Returns (tokens [B], their logprobs [B] per :func:`token_logprobs`, and the full
    log-probabilities [B, V] those come from, for callers that report alternatives).
    """
    scaled = scale(logits, temperature)  # [B, V]
    logp = torch.log_softmax(scaled, dim=-1)
    greedy = scaled.argmax(-1)
    if not bool((temperature > 0).any()):  # every row greedy: top-k and top-p change nothing
        return greedy, logp.gather(-1, greedy[:, None]).squeeze(-1), logp
    masked = scaled  # restricted out of place below
    vocab = logits.shape[-1]
    if bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        kth = torch.sort(masked, dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
        masked = masked.masked_fill(masked < kth, float("-inf"))
    if bool((top_p < 1).any()):
        sorted_logits, order = torch.sort(masked, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(-1) - probs  # probability mass strictly before each token
        drop_sorted = before > top_p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        masked = masked.masked_fill(drop, float("-inf"))
    # Gumbel-max via exponential noise: argmax(p / q), q ~ Exp(1), is a draw from p. The
    # noise is -log(u), u ~ U[0, 1): the same distribution as ``exponential_``, a quarter
    # of its cost on the CPU (u = 0 gives q = inf, a token that cannot win: p = 2^-24 each).
    probs = torch.softmax(masked, dim=-1)
    noise = torch.rand_like(probs)
    for i, g in enumerate(generators):
        if g is not None:
            noise[i] = torch.rand(noise.shape[-1], generator=g, device=noise.device)
    drawn = (probs / noise.log_().neg_()).argmax(-1)
    tokens = torch.where(temperature > 0, drawn, greedy)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1), logp
