#!/usr/bin/env bash
# Installs the build into a scratch prefix, then builds and runs examples/hello_device against
# the installed package with find_package(Strata) — what a user of the library does.
set -euo pipefail
build_dir="$1"
source_dir="$2"
# The build's own C++ compiler: a sanitizer build's library needs that compiler's runtime.
cxx="${3:-c++}"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
cmake --install "$build_dir" --prefix "$scratch/prefix" >/dev/null
cmake -S "$source_dir/examples/hello_device" -B "$scratch/example" -G Ninja \
  -DCMAKE_PREFIX_PATH="$scratch/prefix" -DCMAKE_CXX_COMPILER="$cxx" >/dev/null
cmake --build "$scratch/example" >/dev/null
"$scratch/example/hello_device"
# pkg-config sees the package too.
PKG_CONFIG_PATH="$scratch/prefix/lib/pkgconfig" pkg-config --cflags --libs strata | grep -q -- "-lstrata"
# The installed CLI runs from the prefix: it loads the libstrata installed beside it
# ($ORIGIN/../lib), whatever the prefix, and not one from the build tree.
"$scratch/prefix/bin/strata" --version | grep -q "^strata "
ldd "$scratch/prefix/bin/strata" | grep "libstrata" | grep -q -- "$scratch/prefix/bin/../lib/"
