"""Merge leaderboard folders computed in parallel into one and write its report, computing
nothing (`atskv.eval.leaderboard.merge_folders`):

    python benchmarks/leaderboard_merge.py OUT SOURCE [SOURCE ...]
"""

import sys

from atskv.errors import InputError
from atskv.eval.leaderboard import merge_folders

if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__.strip())
    try:
        print(merge_folders(sys.argv[1], sys.argv[2:])["markdown"].read_text())
    except InputError as error:  # one line, as the CLI gives it
        sys.exit(f"leaderboard_merge: error: {error}")
