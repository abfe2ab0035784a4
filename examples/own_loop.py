"""A nanoGPT-style script trained with SDP: your model, your data, your loop; two lines differ from DDP.

    torchrun --nproc_per_node 2 examples/own_loop.py --coverage 0.5 --out /tmp/gpt-union.pt

With DDP the script would read ``model = DDP(GPT(cfg))``; with SDP the model is built on the meta
device and ``subnetdp.parallelize`` keeps this rank's share of the blocks (the rest are never allocated).
"""

import argparse
import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import subnetdp

VOCAB, CTX, DIM, HEADS, LAYERS = 64, 32, 64, 4, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pre-norm: the residual is inside the block
        h = self.ln1(x)
        causal = torch.triu(torch.ones(x.size(1), x.size(1), dtype=torch.bool, device=x.device), 1)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(CTX, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def batch(gen: torch.Generator, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Arithmetic sequences mod VOCAB: the next token is learnable from the previous two."""
    start = torch.randint(0, VOCAB, (size, 1), generator=gen)
    step = torch.randint(1, 4, (size, 1), generator=gen)
    seq = (start + step * torch.arange(CTX + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--coverage", type=float, default=0.5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--out", default="")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with torch.device("meta"):
        model = GPT()
    model = subnetdp.parallelize(model, units="blocks.*", coverage=args.coverage, seed=0, skip="identity")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(rank)  # each rank its own data shard
    for step in range(args.steps):
        for micro in range(args.accum):
            x, y = batch(gen)
            last = micro == args.accum - 1
            with contextlib.nullcontext() if last else model.no_sync():  # average once, at the last micro-batch
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / args.accum
                loss.backward()
        norm = model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step} loss {loss.item() * args.accum:.4f} norm {float(norm):.3f} "
                  f"(ln {math.log(VOCAB):.2f} at start)")
    if rank == 0:
        print(f"held {model.params_held} parameters ({', '.join(model.units_held)}), "
              f"{model.bytes_per_step} bytes averaged per step")
    union = model.export(GPT())  # collective: the full model in your own class
    if rank == 0 and args.out:
        torch.save(union.state_dict(), args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
