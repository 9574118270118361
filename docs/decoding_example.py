import torch

from atlaslab.models.presets import build_model, tiny_overrides

torch.manual_seed(0)
model = build_model("gated_deltanet", tiny_overrides("gated_deltanet"))
prompt = torch.randint(0, model.cfg.vocab_size, (2, 8))              # [B, T]

logits, state = model.prefill(prompt)                                 # the logits of model(prompt)
token = logits[:, -1].argmax(-1)                                      # [B]
logits, state = model.step(token, state)                              # [B, vocab]: the next position

greedy = model.generate(prompt, max_new_tokens=16)                    # [2, 24]
sampled = model.generate(prompt, 16, temperature=0.8, top_p=0.9, generator=torch.Generator().manual_seed(0))
print(greedy[:, 8:], sampled[:, 8:], sep="\n")
