"""Merge leaderboard folders computed in parallel into one and write its report, computing
nothing (`atskv.eval.leaderboard.merge_folders`); `--variant LABEL=FOLDER` adds the atskv rows of
a run with other selector options as "METHOD (LABEL)":

    python benchmarks/leaderboard_merge.py OUT SOURCE [SOURCE ...] [--variant LABEL=FOLDER ...]
"""

import argparse
import sys

from atskv.errors import InputError
from atskv.eval.leaderboard import merge_folders

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("sources", nargs="+")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=FOLDER")
    args = parser.parse_args()
    if bad := [v for v in args.variant if "=" not in v]:
        parser.error(f"--variant takes LABEL=FOLDER, not {bad[0]!r}")
    try:
        variants = dict(v.split("=", 1) for v in args.variant)
        print(merge_folders(args.out, args.sources, variants)["markdown"].read_text())
    except InputError as error:  # one line, as the CLI gives it
        sys.exit(f"leaderboard_merge: error: {error}")
