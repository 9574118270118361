# Run an experiment from Python and read its learning curves (results.json keeps them; the committed sweeps keep
# only final metrics). Run from the repository root: `python docs/analysis_curves_example.py`.
import pandas as pd

import atlaslab


def analyse(run_dir):
    """The final table and the curves of a finished run folder."""
    df = atlaslab.load_results(run_dir)
    print(df[["variant", "seed", "status", "steps", "test/accuracy"]].to_string(index=False))
    curves = atlaslab.load_curves(run_dir)           # one row per trial and report of the training loop
    val = curves.dropna(subset=["val/accuracy"])      # the evaluations (train/* come every log_interval)
    table = val.pivot_table(index="step", columns="variant", values="val/accuracy", aggfunc="mean")
    print(table.round(2).to_string())
    return df, curves


if __name__ == "__main__":
    pd.set_option("display.width", 120)
    p = atlaslab.prepare("experiments/quickstart.yaml", ["train.steps=100"])   # validates every trial first
    summary = atlaslab.run(p)                                                    # Ray Tune + MLflow + report
    analyse(summary["run_dir"])
