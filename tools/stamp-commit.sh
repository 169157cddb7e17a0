#!/usr/bin/env bash
# Writes .git-commit (ignored by git) at the top of this checkout: the commit the tree is at,
# with "+dirty" when a tracked file differs from it. A copy of the tree without .git (the GPU
# machine's) reads it, so its records' git_commit is the code that ran (app/tracking/records.py).
# Run it right before the copy is made, and carry the file with it:
#   bash tools/stamp-commit.sh      # then run(..., carry=[".git-commit"])
set -eu
cd "$(dirname "$0")/.."
python3 -c 'from app.tracking.records import write_commit_stamp; print("stamped", write_commit_stamp())'
