"""A small, real demonstration of the parts: how many key→value pairs can each memory recall?

For every memory below, N random pairs (unit keys, standard-normal values, d = 16) are written through ``memorize``
(the pairs are shown ``passes`` times, as a test-time learner would see a repeated context), then the
memory is read at the keys and the relative recall error ‖M(φ(k)) − v‖² / ‖v‖² is averaged over pairs,
heads and sequences. No training of outer parameters is involved: this isolates the inner learner, the
way ATLAS §3.1 argues about capacity (a linear ℓ2 memory holds O(d) pairs; polynomial features and deep
memories hold more; the Hebbian dot-product memory suffers crosstalk).

    python -m atlaslab.demo            # prints a table and writes demo_results.md
"""
from __future__ import annotations

import argparse
import time
from typing import Dict, List

import torch

from atlaslab.memory import build_memory
from atlaslab.engines import memorize, read_memory

#: name → (memory spec, constant inner learning rate), each a combination of registered parts.
DEMO_MEMORIES: Dict[str, dict] = {
    "linear attention (dot, GD)": {"memory": {"name": "linear", "init": "zeros"}, "attentional_bias": "dot"},
    "DeltaNet (l2, GD)": {"memory": {"name": "linear", "init": "zeros"}},
    "Longhorn (l2, implicit GD)": {"memory": {"name": "linear", "init": "zeros"}, "inner_optimizer": "implicit_gd"},
    "Omega c=4 (l2, GD, linear)": {"memory": {"name": "linear", "init": "zeros"}, "window": {"size": 4},
                                   "inner_optimizer": {"name": "gd", "lr": 0.5}},
    "poly p=2 (l2, GD, linear)": {"memory": {"name": "linear", "init": "zeros"}, "feature_map": "polynomial",
                                  "inner_optimizer": {"name": "gd", "lr": 0.5}},
    "Titans-style MLP (l2, momentum)": {"memory": "mlp", "inner_optimizer": {"name": "momentum", "lr": 0.1,
                                                                             "momentum": 0.5}},
    "Atlas-style (poly, MLP, Muon, c=4)": {"memory": {"name": "mlp", "residual": False},
                                           "feature_map": "polynomial", "window": {"size": 4},
                                           "inner_optimizer": {"name": "muon", "lr": 0.1, "momentum": 0.5}},
}


def recall_error(spec: dict, pairs: int, dim: int = 16, heads: int = 2, batch: int = 4, passes: int = 3,
                 seed: int = 0) -> float:
    """Mean relative recall error of ``pairs`` key→value associations written ``passes`` times."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.nn.functional.normalize(torch.randn(batch, pairs, heads, dim, generator=g), dim=-1)
    values = torch.randn(batch, pairs, heads, dim, generator=g)
    torch.manual_seed(seed)
    parts = build_memory(spec, heads, dim, dim)
    k, v = keys.repeat(1, passes, 1, 1), values.repeat(1, passes, 1, 1)
    with torch.no_grad():
        _, state = memorize(k, k, v, parts)
        recalled = read_memory(parts, state, keys)
    err = (recalled - values).pow(2).sum(-1) / values.pow(2).sum(-1)
    return err.mean().item()


def run(pair_counts: List[int], passes: int = 3) -> str:
    header = "| memory | " + " | ".join(f"N={n}" for n in pair_counts) + " |"
    lines = [header, "|" + "---|" * (len(pair_counts) + 1)]
    for name, spec in DEMO_MEMORIES.items():
        errs = [recall_error(spec, n, passes=passes) for n in pair_counts]
        lines.append(f"| {name} | " + " | ".join(f"{e:.3f}" for e in errs) + " |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--out", default="demo_results.md")
    args = parser.parse_args(argv)
    print(f"Relative recall error (lower is better), d = 16, {args.passes} passes over the pairs:\n")
    start = time.time()
    table = run(args.pairs, args.passes)
    with open(args.out, "w") as f:
        f.write("# atlaslab demo: recall error of test-time memories\n\n"
                f"Command: `python -m atlaslab.demo --pairs {' '.join(map(str, args.pairs))} "
                f"--passes {args.passes}`\n\n{table}\n")
    print(f"\nwritten {args.out} in {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
