"""A small GPT-2 training job for `snaplab run` (capture test): 6 steps, a snapshot every 2."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import snapshot_lab.capture as capture

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=4096, n_positions=512)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step, seq in enumerate([128, 384, 256, 512, 192, 320], 1):  # noqa: B007 (printed below)
    ids = torch.randint(0, 4096, (8, seq), device="cuda")
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    capture.step()
print("trained", step, "steps")
