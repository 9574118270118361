# A sweep in a notebook: the recall-against-state sweep of the results pages (run folder rvs_wd, committed under
# docs/results/recall-vs-state/runs/), read with atlaslab.load_results. Run from the repository root; each "# %%"
# is a notebook cell. What it prints: docs/analysis_example.txt (tests/docs/test_analysis.py reruns it).

# %% one row per trial: its variant, row, seed, config, status and final metrics
import pandas as pd

import atlaslab

pd.set_option("display.width", 120)
df = atlaslab.load_results("docs/results/recall-vs-state/runs/rvs_wd")
print(df.shape)
print(df[["key", "variant", "seed", "state_size", "status", "test/accuracy"]].head(4).to_string(index=False))

# %% a trial's parameters and config are dicts: pull out the axis of the sweep
df["heads"] = df["params"].map(lambda p: p["model.mixers.*.num_heads"])
print(df.loc[0, "config"]["train"]["lr"], df.loc[0, "config"]["task"]["num_kv_pairs"])

# %% mean ± std over the seeds, per model and number of heads (the table of the recall-against-state page)
table = (df.groupby(["variant", "heads"], sort=False)
           .agg(state=("state_size", "first"), mean=("test/accuracy", "mean"), std=("test/accuracy", "std"),
                seeds=("seed", "nunique")))
print(table.round(3).to_string())

# %% one column per number of heads: where more state (fewer, wider heads) buys recall
print(df.pivot_table(index="variant", columns="heads", values="test/accuracy", aggfunc="mean").round(3).to_string())

# %% the rows whose seeds disagree by more than 0.3: read their means with care
spread = df.groupby(["variant", "heads"])["test/accuracy"].agg(lambda s: s.max() - s.min())
print(spread[spread > 0.3].round(2).to_string())
