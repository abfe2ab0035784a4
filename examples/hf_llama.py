"""SDP on a Hugging Face model: LlamaForCausalLM's decoder layers as units, the union saved with save_pretrained.

    torchrun --nproc_per_node 2 examples/hf_llama.py --out /tmp/llama-union

Each rank builds the model on the meta device, keeps half of the decoder layers (the others are skipped:
a decoder layer is pre-norm, its residual inside), trains on its own random tokens, then the ranks
assemble the union model into a plain LlamaForCausalLM, which is saved, loaded back and compared.
"""

import argparse

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import subnetdp

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=3)
args = p.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
with torch.device("meta"):
    model = LlamaForCausalLM(config)
model = subnetdp.parallelize(model, units="model.layers.*", coverage=0.5, seed=0)
print(f"rank {rank}: layers {model.units_held}, {model.params_held} parameters held")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(rank)
for step in range(args.steps):
    ids = torch.randint(0, config.vocab_size, (4, 16), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()  # owner-group averaging done when backward returns
    model.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    print(f"rank {rank} step {step}: loss {loss.item():.4f}")

union = LlamaForCausalLM(config)
model.export(union)  # collective: every rank hands in the tensors it writes
if rank == 0:
    union.save_pretrained(args.out)
    back = LlamaForCausalLM.from_pretrained(args.out)
    ids = torch.arange(16).unsqueeze(0)
    same = torch.equal(union(ids).logits, back(ids).logits)
    print(f"union saved to {args.out}; reloaded logits equal: {same}")
    if not same:
        raise SystemExit(1)
dist.destroy_process_group()
