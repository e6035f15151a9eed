#!/usr/bin/env bash
# Builds git revision REV's sm90 extension (default HEAD) with that revision's setup.py, in DIR, for
# tools/ab/sm90_builds.py. Prints the path of the .so.   bash tools/ab/build_sm90_at.sh [REV] [DIR]
# On the device machine the repository's history stops at the commit the session started from (its HEAD there),
# whatever the shipped working tree holds: there HEAD means "the session's starting point".
set -euo pipefail
rev=${1:-HEAD}; dir=${2:-/tmp/sm90_$rev}
rm -rf "$dir" && mkdir -p "$dir"
git archive "$rev" | tar -x -C "$dir"
(cd "$dir" && MAX_JOBS=${MAX_JOBS:-16} python setup.py -q build_ext --inplace >&2)
ls "$dir"/sage_compile/_sm90*.so
