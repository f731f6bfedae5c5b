"""Choose a model's training recipe on a validation split (never the test set): each candidate trains on
80 % of the training images (stratified, seeded: Dataset.validation_split) and is scored on the other 20 %.

    PYTHONPATH=. python benchmarks/recipes.py model=resnet8 data=mnist5k train.epochs=8 \
        --try 'train=resnet' 'train=resnet train.lr=0.1' 'train=default'

Prints one line per candidate (validation accuracy, seconds) and appends them to benchmarks/recipes.csv
with the thread count and the command."""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runner.config import compose  # noqa: E402
from runner.data import load_dataset  # noqa: E402
from runner.store import read_rows, write_csv  # noqa: E402
from runner.train import evaluate_accuracy, train_model  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="overrides every candidate shares")
    parser.add_argument("--try", dest="candidates", nargs="+", required=True, help="one quoted override set each")
    parser.add_argument("--out", default=str(Path(__file__).with_name("recipes.csv")))
    args = parser.parse_args()
    rows = []
    for cand in args.candidates:
        cfg = compose("train", [*shlex.split(cand), *args.overrides])
        data = load_dataset(cfg.data).validation_split(0.2, 0)
        t0 = time.perf_counter()
        model, _ = train_model(cfg, data, torch.device("cpu"))
        seconds = time.perf_counter() - t0
        acc = evaluate_accuracy(model, data.test_x, data.test_y, 1000, torch.device("cpu"))
        row = {"model": cfg.model.name, "data": cfg.data.name, "candidate": cand, "epochs": int(cfg.train.epochs),
               "val_accuracy": acc, "train_s": round(seconds, 1), "threads": torch.get_num_threads(),
               "command": " ".join(["python benchmarks/recipes.py", *args.overrides, "--try", repr(cand)])}
        print(f"{cand:40s} validation {100 * acc:.2f} %  ({seconds:.0f} s)", flush=True)
        rows.append(row)
    # a log of candidates, not a results store (no row keys): the rows so far and these, rewritten atomically
    write_csv(Path(args.out), [*read_rows(Path(args.out)), *rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
