#!/usr/bin/env bash
# Builds the sm90 extension of git revision REV (default HEAD) into DIR/_sm90<suffix>.so, with setup.py's nvcc
# flags, for tools/ab/sm90_builds.py. Prints the path.   bash tools/ab/build_sm90_at.sh [REV] [DIR]
set -euo pipefail
rev=${1:-HEAD}; dir=${2:-/tmp/sm90_$rev}
mkdir -p "$dir/src"
for f in attention.cu binding.cpp params.h wgmma.cuh; do git show "$rev:csrc/sm90/$f" > "$dir/src/$f"; done
target="$dir/_sm90$(python -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
nvcc "$dir/src/binding.cpp" "$dir/src/attention.cu" -o "$target" -shared -O3 -std=c++17 -Xcompiler -fPIC \
  --cudart static -I "$(python -c 'import pybind11; print(pybind11.get_include())')" \
  -I "$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" -gencode=arch=compute_90a,code=sm_90a >&2
echo "$target"
