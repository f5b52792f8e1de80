#!/usr/bin/env bash
# Before / after numbers from one GPU: run the same Python command against two dsfuse source trees (this commit and
# an earlier one), one after the other on one machine. Each tree is installed on its own with `pip install --target`
# and the command runs with `python -P`, so that the working directory's dsfuse/ folder never shadows the tree
# under test; DSFUSE_COMMIT names each tree in the results. Make a tree with
#     mkdir -p .gpu/base && git archive <commit> | tar -x -C .gpu/base && echo <commit> > .gpu/base/.commit
# then, from the repository root on the device machine:
#     TREES=". .gpu/base" bash benchmarks/two_trees.sh -m dsfuse.bench model --checkpoint /tmp/v32fp8 --seq 8192
# ({tree} in the arguments becomes each tree's name, e.g. --json "$OUT/decode_{tree}.json"). Wheels in .whl/ (a newer
# transformers) are installed beside them. LIMIT bounds each run (seconds); at the limit, the run's Python stacks
# are printed (faulthandler on SIGABRT) before it stops.
set -uo pipefail
TREES=${TREES:?"TREES: two or more source trees, e.g. '. .gpu/base'"}
SITE=${SITE:-/tmp/dsfuse_trees}
mkdir -p "$SITE"
extra=""
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE/wheels" .whl/*.whl
  extra=":$SITE/wheels"
fi
for tree in $TREES; do
  if [[ -f "$tree/.commit" ]]; then
    name=$(cat "$tree/.commit")
  else
    name=$(git -C "$tree" rev-parse --short HEAD 2>/dev/null || basename "$(realpath "$tree")")
  fi
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target \
    "$SITE/$name" "$tree" >"$SITE/$name.pip.log" 2>&1 || { echo "installing $tree failed"; tail "$SITE/$name.pip.log"; }
  echo "=== tree $name ($(date -u +%H:%M:%S)): python3 -P ${*//\{tree\}/$name}"
  DSFUSE_COMMIT=$name PYTHONPATH="$SITE/$name$extra" timeout -s ABRT "${LIMIT:-600}" \
    python3 -P -X faulthandler "${@//\{tree\}/$name}"
  echo "=== tree $name: exit $?"
done
