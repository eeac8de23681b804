"""The streaming CTC acoustic model: causal conv front end, one-way GRUs, a small look-ahead conv.

Every layer is causal, so the model streams exactly: feeding an utterance whole or in chunks
(a multiple of ``SUBSAMPLING`` frames) with the state carried gives the same outputs. The model
"looks ahead" by emitting late (CTC does not care where a label fires): the head conv sees three
GRU frames, so a label can use 80 ms after its own frame, and the caller flushes
``FLUSH_FRAMES`` frames of padding at the end of a stream so the last labels come out.

    features [B, T, mels]
      -> conv(k5, s2) -> GELU -> conv(k5, s2) -> GELU -> LayerNorm   [B, T/4, conv]
      -> GRU x layers                                                  [B, T/4, hidden]
      -> conv(k3) -> GELU -> Linear -> log_softmax                     [B, T/4, vocab]

State (batch first): ``state.0`` conv1 input cache [B, 3, mels], ``state.1`` conv2 input cache
[B, 3, conv], ``state.2`` GRU hidden [B, layers, hidden], ``state.3`` head conv cache [B, 2, hidden].
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

SUBSAMPLING = 4
FLUSH_FRAMES = 16


@dataclass(frozen=True)
class ModelConfig:
    num_mel_bins: int = 64
    conv_channels: int = 256
    hidden: int = 256
    layers: int = 3
    vocab_size: int = 30

    def to_dict(self) -> dict:
        return asdict(self)


class CausalConv(nn.Module):
    """Conv1d over time whose cache holds the last ``kernel - stride`` input frames."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, stride=stride)
        self.cache_frames = kernel - stride

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x [B, T, C], cache [B, K - S, C]; T a multiple of the stride
        full = torch.cat([cache, x], dim=1)
        y = self.conv(full.transpose(1, 2)).transpose(1, 2)  # [B, T / S, Cout]
        return y, full[:, full.shape[1] - self.cache_frames :, :]


class StreamingCTC(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.conv1 = CausalConv(cfg.num_mel_bins, cfg.conv_channels, 5, 2)
        self.conv2 = CausalConv(cfg.conv_channels, cfg.conv_channels, 5, 2)
        self.norm = nn.LayerNorm(cfg.conv_channels)
        self.gru = nn.GRU(cfg.conv_channels, cfg.hidden, num_layers=cfg.layers, batch_first=True)
        self.head_conv = CausalConv(cfg.hidden, cfg.hidden, 3, 1)
        self.out = nn.Linear(cfg.hidden, cfg.vocab_size)
        self.act = nn.GELU()

    def state_shapes(self) -> list[tuple[int, ...]]:
        c = self.cfg
        return [(3, c.num_mel_bins), (3, c.conv_channels), (c.layers, c.hidden), (2, c.hidden)]

    def initial_state(self, batch: int) -> list[torch.Tensor]:
        return [torch.zeros(batch, *s) for s in self.state_shapes()]

    def forward(
        self, features: torch.Tensor, s0: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor, s3: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        x, n0 = self.conv1(features, s0)
        x = self.act(x)
        x, n1 = self.conv2(x, s1)
        x = self.norm(self.act(x))
        x, h = self.gru(x, s2.transpose(0, 1).contiguous())  # GRU state is [layers, B, H] inside torch
        x, n3 = self.head_conv(x, s3)
        logits = self.out(self.act(x))
        return torch.log_softmax(logits, dim=-1), n0, n1, h.transpose(0, 1), n3


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
