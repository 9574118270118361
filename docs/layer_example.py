"""An atlaslab memory layer inside a user's own small torch model, trained for a few steps."""
import torch
from torch import nn

from atlaslab.hf.layers import MemoryMixer


class TinyModel(nn.Module):
    def __init__(self, vocab: int = 16, hidden: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.norm = nn.LayerNorm(hidden)
        # a DeltaNet-style linear memory with decay; any registered memory spec works here
        self.memory = MemoryMixer(hidden_size=hidden, num_heads=2, layer_idx=0,
                                  memory={"memory": {"name": "linear"}, "attentional_bias": {"name": "l2"},
                                          "retention": {"name": "decay"}, "chunk_size": 8})
        self.mlp = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 2 * hidden), nn.GELU(),
                                 nn.Linear(2 * hidden, hidden))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids, attention_mask=None, past_key_values=None, use_cache=False):
        x = self.embed(ids)
        o, _, past_key_values = self.memory(self.norm(x), attention_mask=attention_mask,
                                            past_key_values=past_key_values, use_cache=use_cache)
        x = x + o
        return self.head(x + self.mlp(x)), past_key_values


def train(steps: int = 40, seed: int = 0):
    """Learn to copy the previous token; returns the loss of every step."""
    torch.manual_seed(seed)
    model = TinyModel()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 16, (16, 24))
        logits, _ = model(ids)
        loss = nn.functional.cross_entropy(logits[:, 1:].reshape(-1, 16), ids[:, :-1].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


if __name__ == "__main__":
    model, losses = train()
    print(f"loss {losses[0]:.3f} → {losses[-1]:.3f}")
    # the same layer decodes token by token from a cache: chained calls equal one call
    ids = torch.randint(0, 16, (1, 10))
    with torch.no_grad():
        full, _ = model(ids)
        first, cache = model(ids[:, :6], use_cache=True)
        rest, cache = model(ids[:, 6:], past_key_values=cache, use_cache=True)
    print("chained == one call:", torch.allclose(torch.cat([first, rest], 1), full, atol=1e-5))
