"""Synthesizer (Tay et al. 2021, "Synthesizer: Rethinking Self-Attention for Transformer Models"): `"synthesizer"`.

Shape legend: b batch, h heads, n query length, m key length, d head dim, D hidden size, L `max_position_embeddings`,
a, c the factorised sizes (a · c >= L), k the rank of the factorised random synthesizer.

The Synthesizer does not compare queries with keys: it synthesises each head's `[n, m]` logits and applies
`Y = softmax(logits) G(X)`, with G the value projection `v_proj`. `synthesizer_mode` picks the synthesiser:

- `"dense"`: B_i = F(X_i) = W_2 relu(W_1 X_i + b_1) + b_2 maps each token to L logits, one per key position.
- `"random"`: one learned (or, with `synthesizer_random_trainable=False`, fixed) matrix R `[L, L]` per head,
  independent of the input.
- `"factorized_dense"`: A = F_A(X_i) `[a]`, B = F_B(X_i) `[c]`; the logit for key position j is
  A[j mod a] · B[j div a]: one factor is tiled, the other repeated, so the products do not repeat within a block
  (the paper's H_A(A) * H_B(B)). a = `synthesizer_factor_k`, c = ceil(L / a); F_A and F_B share the hidden layer.
- `"factorized_random"`: R = R_1 R_2ᵀ with R_1, R_2 `[L, k]`, k = `synthesizer_factor_k` (the paper uses 8).

`synthesizer_mix=True` adds standard dot-product logits with learned per-head mixture weights
(softmax(α) over {synthesised, Q Kᵀ / sqrt(d)}): the paper's D+V and R+V models. Only then are q_proj and k_proj
built; without the mixture the kind has no q_proj / k_proj at all, so every parameter it owns is trained.

Logits are defined for the model's maximum length L and indexed by position (counted over real tokens, as the
model's position ids, so left padding does not shift them): a shorter input uses the leading rows and columns.
Causal decoders mask the upper triangle; padded keys are masked.

Cost: the dense, random and mixture forms are quadratic in length by nature (an `[n, m]` logit matrix per head),
and `random` holds h · L² parameters per layer: they are for moderate L and for comparison, not for very long inputs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import initialization as init

from .attention_base import LongAttnAttention
from .numerics import compute_dtype, hide_logits


class SynthesizerAttention(LongAttnAttention):
    """The `"synthesizer"` kind: synthesised attention weights applied to the values.

    Config fields:
        synthesizer_mode: `"dense"` (default), `"random"`, `"factorized_dense"` or `"factorized_random"`.
        synthesizer_random_trainable: Train the random matrices (default True) or keep them fixed.
        synthesizer_factor_k: a of the factorised dense form, rank k of the factorised random form (default 8).
        synthesizer_mix: Mix the synthesised logits with dot-product logits, learned weights (default False).

    Parameters (besides v_proj, o_proj; q_proj and k_proj only with the mixture): dense `synth_hidden`,
    `synth_logits`; factorised dense `synth_hidden`, `synth_logits_a`, `synth_logits_b`; random `synth_random`
    (`[L, h·L]`, row = query position); factorised random `synth_random_a`, `synth_random_b` (`[L, h·k]`);
    mixture `synth_mix` (`[h, 2]`).

    `output_attentions=True` returns the synthesised probabilities `[b, h, n, m]` the output was computed from
    (after dropout in training; the only attention there is).
    The KV cache of a decoder keeps the values (and keys with the mixture); without keys it stores a one-channel
    placeholder so that the cache still counts its length.
    """

    attention_type = "synthesizer"
    settings = ("mode", "mix", "factor_k")

    def __init__(self, config: Any, *, layer_idx: int, is_causal: bool):
        super().__init__(config, layer_idx=layer_idx, is_causal=is_causal)
        self.max_len = config.max_position_embeddings
        hidden, heads, length = config.hidden_size, self.num_heads, self.max_len
        if not self.mix:
            self.q_proj = self.k_proj = None
        if self.mode in ("dense", "factorized_dense"):
            self.synth_hidden = nn.Linear(hidden, hidden)
        if self.mode == "dense":
            self.synth_logits = nn.Linear(hidden, heads * length)
        elif self.mode == "factorized_dense":
            self.factor_c = -(-length // self.factor_k)
            self.synth_logits_a = nn.Linear(hidden, heads * self.factor_k)
            self.synth_logits_b = nn.Linear(hidden, heads * self.factor_c)
        elif self.mode == "random":
            self.synth_random = nn.Embedding(length, heads * length)
        else:
            self.synth_random_a = nn.Embedding(length, heads * self.factor_k)
            self.synth_random_b = nn.Embedding(length, heads * self.factor_k)
        if self.mode in ("random", "factorized_random") and not config.synthesizer_random_trainable:
            for param in self.random_tables():
                param.requires_grad_(False)
        self.synth_mix = nn.Parameter(torch.zeros(heads, 2)) if self.mix else None
        self.reset_kind_parameters()

    def random_tables(self) -> list[torch.Tensor]:
        """The input-independent matrices of the random modes (empty for the dense modes)."""
        if self.mode == "random":
            return [self.synth_random.weight]
        if self.mode == "factorized_random":
            return [self.synth_random_a.weight, self.synth_random_b.weight]
        return []

    @torch.no_grad()
    def reset_kind_parameters(self) -> None:
        """Random logits with unit variance (a fixed random synthesiser must not start as a uniform average);
        equal mixture weights."""
        if self.mode == "random":
            init.normal_(self.synth_random.weight, mean=0.0, std=1.0)
        elif self.mode == "factorized_random":
            # Each factor with std k^(-1/4), so that the logits R_1 R_2ᵀ have unit variance too.
            for table in (self.synth_random_a, self.synth_random_b):
                init.normal_(table.weight, mean=0.0, std=self.factor_k**-0.25)
        if self.synth_mix is not None:
            init.zeros_(self.synth_mix)

    # ------------------------------------------------------------------------------------------ the logits
    def synthesized_logits(
        self, hidden_states: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor | None, m: int
    ) -> torch.Tensor:
        """Synthesised logits of the n new tokens over the m keys.

        Args:
            hidden_states: `[b, n, D]`, the new tokens (the dense forms read them; the random forms do not: None).
            query_pos: Long `[b or 1, n]`, position of each query.
            key_pos: Long `[b, m]`, position of each key, or None when the keys are positions 0..m-1.
            m: Number of keys.

        Returns:
            `[b or 1, h, n, m]`.
        """
        h, n = self.num_heads, query_pos.shape[-1]
        if self.mode in ("dense", "factorized_dense"):
            hidden = torch.relu(self.synth_hidden(hidden_states))  # [b, n, D]
            b = hidden.shape[0]
            if self.mode == "dense":
                # Only the rows of W_2 for positions < m are needed: [h, m, D] instead of [h, L, D].
                weight = self.synth_logits.weight.view(h, self.max_len, -1)[:, :m]
                bias = self.synth_logits.bias.view(h, self.max_len)[:, :m]
                logits = torch.einsum("bnx,hmx->bhnm", hidden, weight) + bias[None, :, None, :]  # [b, h, n, m]
                return logits if key_pos is None else logits.gather(3, _expand_index(key_pos, logits.shape))
            a = self.synth_logits_a(hidden).view(b, n, h, self.factor_k).transpose(1, 2)  # [b, h, n, a]
            c = self.synth_logits_b(hidden).view(b, n, h, self.factor_c).transpose(1, 2)  # [b, h, n, c]
            positions = torch.arange(m, device=hidden.device)[None] if key_pos is None else key_pos  # [b|1, m]
            shape = (b, h, n, m)
            return a.gather(3, _expand_index(positions % self.factor_k, shape)) * c.gather(
                3, _expand_index(positions // self.factor_k, shape)
            )
        if self.mode == "random":
            table = self.synth_random.weight.view(self.max_len, h, self.max_len)
            if key_pos is None:
                rows = table[:, :, :m][query_pos]  # [b|1, n, h, m]
                return rows.permute(0, 2, 1, 3)
            rows = table[query_pos].permute(0, 2, 1, 3)  # [b, h, n, L]
            return rows.gather(3, _expand_index(key_pos, (*rows.shape[:3], m)))
        factor_q = self.synth_random_a.weight.view(self.max_len, h, self.factor_k)[query_pos]  # [b|1, n, h, k]
        keys = torch.arange(m, device=query_pos.device)[None] if key_pos is None else key_pos
        factor_k = self.synth_random_b.weight.view(self.max_len, h, self.factor_k)[keys]  # [b|1, m, h, k]
        return torch.einsum("bnhk,bmhk->bhnm", factor_q, factor_k)

    # ------------------------------------------------------------------------------------------ attention
    def attention_inputs(self, hidden_states, *, key_padding_mask, position_embeddings):
        """The values `[b, h, n, d]`; queries and keys only with the mixture (rotated), else no queries and
        one-channel placeholder keys `[b, h, n, 1]`, so that the KV cache still counts its length."""
        if self.mix:
            return super().attention_inputs(
                hidden_states, key_padding_mask=key_padding_mask, position_embeddings=position_embeddings
            )
        v = self.split_heads(self.v_proj(hidden_states))  # [b, h, n, d]
        return None, v.new_zeros(*v.shape[:3], 1), v

    def attend_inputs(self, q, k, v, *, hidden_states, key_padding_mask, global_mask, dense):
        """The synthesised attention (`attend_synthesized`); with `dense`, its probabilities after dropout
        `[b, h, n, m]` (the only attention there is)."""
        out, probs = self.attend_synthesized(q, k, v, attention_mask=key_padding_mask, hidden_states=hidden_states)
        return out, (probs.to(v.dtype) if dense else None)

    def attend_synthesized(
        self,
        q: torch.Tensor | None,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None,
        hidden_states: torch.Tensor | None,
        query_length: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The synthesised attention of the n new tokens over the m keys (cached ones included).

        Args:
            q, k: `[b, h, n, d]`, `[b, h, m, d]` (read by the mixture only; q None without it).
            v: `[b, h, m, d]`.
            attention_mask: `[b, m]` bool, True = real token; None = no padding.
            hidden_states: `[b, n, D]` (read by the dense forms only; None for the random forms).
            query_length: n when `hidden_states` is None.

        Returns:
            (`[b, h, n, d]` output, the probabilities it was computed from, after dropout, `[b, h, n, m]`).
        """
        b = v.shape[0]
        n = hidden_states.shape[1] if hidden_states is not None else query_length
        m = v.shape[2]
        if m > self.max_len:
            raise ValueError(
                f"the synthesizer's logits are defined for {self.max_len} positions (`max_position_embeddings`), got "
                f"{m} keys."
            )
        if attention_mask is None:
            key_pos = None
            query_pos = torch.arange(m - n, m, device=v.device)[None]  # [1, n]: the new tokens are the last ones
        else:
            key_pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [b, m], counted over real tokens
            query_pos = key_pos[:, m - n :]
        dtype = compute_dtype(v.dtype)
        logits = self.synthesized_logits(hidden_states, query_pos, key_pos, m).to(dtype)  # [b|1, h, n, m]
        if self.mix:
            weights = torch.softmax(self.synth_mix.to(dtype), dim=-1)  # [h, 2]
            dot = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * self.scale  # [b, h, n, m]
            logits = weights[None, :, 0, None, None] * logits + weights[None, :, 1, None, None] * dot
        visible = self._visible(attention_mask, n, m, v.device)  # [b|1, 1, n, m]
        probs = torch.softmax(hide_logits(logits, ~visible), dim=-1)
        # [b, h, n, m]: the input-independent modes give one matrix for the batch; expanded before dropout, so that
        # every sequence draws its own dropout mask (dropout of the shared matrix would drop alike in all of them).
        probs = (probs * visible).expand(b, -1, -1, -1)  # a row without visible keys (all padding) is zeros
        dropped = nn.functional.dropout(probs, p=self.dropout_p) if self.training and self.dropout_p > 0 else probs
        # The weights the output was computed from (after dropout, as transformers' eager attention returns them).
        return (dropped @ v.to(dtype)).to(v.dtype), dropped  # [b, h, n, d], [b, h, n, m]

    def _visible(self, attention_mask: torch.Tensor | None, n: int, m: int, device: torch.device) -> torch.Tensor:
        """Bool `[b|1, 1, n, m]`: causal (query i is position m - n + i) and real keys."""
        visible = torch.ones(1, 1, n, m, dtype=torch.bool, device=device)
        if self.is_causal:
            visible = visible & torch.ones(n, m, dtype=torch.bool, device=device).tril(m - n)
        if attention_mask is not None:
            visible = visible & attention_mask[:, None, None, :]
        return visible


def _expand_index(positions: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Key positions `[b|1, m]` as a gather index over the last dim of a `[b, h, n, m']` tensor -> `[b, h, n, m]`."""
    return positions[:, None, None, :].expand(shape[0], shape[1], shape[2], positions.shape[-1])
