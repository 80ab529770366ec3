"""Plot of the probe's runs: us per draft layer against the dependencies in
a layer, per variant (python results/h200/persistent_layer/plot.py)."""
import json
import os

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = os.path.dirname(os.path.abspath(__file__))
RUNS = {1: "one_barrier", 4: "layers24", 8: "eight_barriers"}  # dependencies a layer -> file
LABELS = {"stream": "persistent, no barrier (bytes alone)",
          "barrier": "persistent, grid barriers",
          "exchange": "persistent, barriers + activations exchanged",
          "kernels": "one kernel per phase (today's structure)"}


def main():
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for variant, label in LABELS.items():
    points = []
    for deps, name in RUNS.items():
      with open(os.path.join(HERE, "runs", f"{name}.json")) as f:
        v = json.load(f)["variants"].get(variant)
      if v and "us_per_layer" in v:
        points.append((deps, v["us_per_layer"]))
    ax.plot(*zip(*points), marker="o", label=label)
  # the 8 kernels of a draft layer-pass in runs/trace_step.json, us per call, summed
  ax.axhline(29.3, color="gray", ls="--", lw=1)
  ax.text(1, 30.2, "the package's draft layer-pass today (8 kernels, same H200)", fontsize=8,
          color="gray")
  ax.set_xlabel("dependent phases per layer (grid barriers or kernel boundaries)")
  ax.set_ylabel("us per layer (0.5B draft's 34.6 MB, 16 rows)")
  ax.set_xticks(sorted(RUNS))
  ax.set_ylim(0, 38)
  ax.legend(fontsize=8, loc="lower right")
  ax.set_title("A persistent draft layer, probe on one H200 (jax 0.11.2)")
  fig.tight_layout()
  fig.savefig(os.path.join(HERE, "persistent_layer.png"), dpi=120)


if __name__ == "__main__":
  main()
