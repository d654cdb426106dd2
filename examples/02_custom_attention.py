"""A custom attention module monitored through an explicit spec.

Run:  .venv/bin/python examples/02_custom_attention.py   (a few seconds on a CPU)

The module keeps Q, K and V in one fused ``qkv`` Linear whose rows are
[all Q | all K | all V] and its head count in ``heads``. ``Monitor(model)`` alone
finds it too (the packing is read from the computation at the first forward);
a spec pins the layout instead: it names the weight and the packing, and the
first forward checks it against the q and k the kernel receives.
"""

import torch
import torch.nn.functional as F
from torch import nn

from diag import MemorySink, QKVLayout
from hooks import Monitor

D_MODEL, HEADS, D_HEAD = 64, 4, 16


class MyAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = HEADS
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)  # rows: [Q heads | K heads | V heads]
        self.out = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # (B, T, E)
        q, k, v = self.qkv(x).split(D_MODEL, dim=-1)  # 3 x (B, T, E)
        q, k, v = (z.view(b, t, self.heads, D_HEAD).transpose(1, 2) for z in (q, k, v))  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        return self.out(y.transpose(1, 2).reshape(b, t, D_MODEL))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D_MODEL)
        self.attn = MyAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.norm(x))


class Model(nn.Module):
    def __init__(self, n_blocks: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.head = nn.Linear(D_MODEL, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).squeeze(-1)  # (B, T)


def main() -> None:
    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    memory = MemorySink()
    spec = {"blocks.*.attn": QKVLayout(n_heads=HEADS, head_dim=D_HEAD, q="qkv.weight", packing="fused")}
    with Monitor(model, every=1, spec=spec, sinks=[memory]) as monitor:
        for layer in monitor.layers:
            lay = layer.layout
            print(f"{layer.label}  {layer.name}  {type(layer.module).__name__}  "
                  f"heads={lay.n_heads} head_dim={lay.head_dim} packing={lay.packing}")
        model.train()
        for step in range(5):
            x = torch.randn(8, 32, D_MODEL)  # (B, T, E)
            loss = model(x).square().mean()
            loss.backward()
            monitor.step(step, loss=loss)  # after backward, before optimizer.step()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    for tag in ("qk_sigma1/L00/H00", "attn_entropy/L00/H00", "grad_ratio_qk_v/L00", "update_ratio_q/L00"):
        step, value = memory.scalars(tag)[-1]
        print(f"{tag:22s} step {step}: {value:.4f}")


if __name__ == "__main__":
    main()
