#!/usr/bin/env bash
# Fetch real containerds with their embedded NRI, and runc, for the end-to-end test
# tests/e2e/test_containerd.py: Debian trixie's containerd (1.7.x) and Debian sid's
# (2.x), so that the test runs against both NRI generations.
#
# usage: tests/e2e/fetch-containerd.sh CACHE_DIR
#   Downloads containerd from trixie and from sid, and runc from bookworm (deb.debian.org,
#   main), with a PRIVATE apt configuration under CACHE_DIR/apt: the system's sources,
#   lists, package cache and preferences are neither read nor written. Extracts each
#   package (dpkg -x, nothing is installed) into its own tree under CACHE_DIR/root and
#   makes one directory per containerd, CACHE_DIR/containerd-MAJOR.MINOR, holding
#   containerd, ctr, containerd-shim-runc-v2 and runc (the same runc for every one).
#   Prints CACHE_DIR: the test runs once per containerd-* directory in it. Idempotent:
#   once every directory is complete, a second run prints CACHE_DIR without touching
#   the network.
#
#   Why runc from bookworm: trixie's runc needs glibc 2.38, bookworm hosts (this project's
#   CI image) have 2.36; containerd's own binaries (1.7 and 2.x) need only glibc 2.34.
#   Bookworm's runc (1.1.x) runs on bookworm and anything newer, and does what the test
#   asks of both containerds (2.x wants runc 1.2+ only for user namespaces and recursive
#   read-only mounts, docs/containerd-2.0.md; the sid package accepts any runc). sid
#   moves: a containerd there that no longer runs here fails this script, never the
#   test half way.
#
#   export NRI_ACCEL_E2E_BIN="$(tests/e2e/fetch-containerd.sh ~/.cache/nri-accel-e2e)"
#
# Needs apt-get, dpkg and the Debian archive keyring (Debian hosts have them; elsewhere,
# install debian-archive-keyring). Uses the host's architecture (amd64, arm64, ...).
set -euo pipefail
shopt -s inherit_errexit  # a failure inside $(...) fails the script too

if [ "$#" -ne 1 ]; then
  echo "usage: $0 CACHE_DIR" >&2; exit 2
fi
mkdir -p "$1"
cache="$(cd "$1" && pwd)"
tools=(containerd ctr containerd-shim-runc-v2 runc)
containerd_suites=(trixie sid)
runc_suite=bookworm

# CACHE_DIR/runtimes names the containerd-* directories of the last complete fetch.
complete() {
  local dir t
  [ -s "$cache/runtimes" ] || return 1
  [ "$(wc -l < "$cache/runtimes")" -eq "${#containerd_suites[@]}" ] || return 1
  while read -r dir; do
    for t in "${tools[@]}"; do [ -x "$cache/$dir/$t" ] || return 1; done
  done < "$cache/runtimes"
}

if complete; then
  echo "$cache"; exit 0
fi

keyring=/usr/share/keyrings/debian-archive-keyring.gpg
for need in apt-get dpkg dpkg-deb; do
  command -v "$need" >/dev/null || { echo "fetch-containerd: $need not found" >&2; exit 1; }
done
[ -r "$keyring" ] || { echo "fetch-containerd: $keyring not found (debian-archive-keyring)" >&2; exit 1; }

apt="$cache/apt"
mkdir -p "$apt/sources" "$apt/preferences" "$apt/lists/partial" "$apt/cache/archives/partial"
rm -f "$apt"/sources/*.sources  # an earlier layout's too
printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: %s\nComponents: main\nSigned-By: %s\n' \
  "${containerd_suites[*]} $runc_suite" "$keyring" > "$apt/sources/debian.sources"
opts=(
  -o "Dir::Etc::SourceList=/dev/null"
  -o "Dir::Etc::SourceParts=$apt/sources"
  -o "Dir::Etc::Preferences=/dev/null"
  -o "Dir::Etc::PreferencesParts=$apt/preferences"
  -o "Dir::State::Lists=$apt/lists"
  -o "Dir::Cache=$apt/cache"
  -o "Dir::Cache::archives=$apt/cache/archives"
  -o "APT::Sandbox::User=root"
  -o "Acquire::Languages=none"
)

apt-get -qq "${opts[@]}" update >&2
# One download directory per package: containerd from two suites share a package name.
rm -rf "$apt/debs"
download() {  # PACKAGE SUITE -> the .deb's path
  local dir="$apt/debs/$1-$2"
  mkdir -p "$dir"
  (cd "$dir" && apt-get -qq "${opts[@]}" download "$1/$2" >&2)
  ls "$dir"/*.deb
}

# Remove what an earlier fetch left, in this layout or the trixie-only one (bin/, versions).
rm -rf "$cache/root" "$cache/bin" "$cache/versions" "$cache/runtimes" "$cache"/containerd-*
mkdir -p "$cache/root"
: > "$cache/runtimes.new"

find_tool() {  # TREE TOOL -> path of TOOL in the extracted TREE
  local dir
  for dir in usr/bin usr/sbin bin sbin; do
    if [ -x "$1/$dir/$2" ]; then echo "$1/$dir/$2"; return 0; fi
  done
  echo "fetch-containerd: $2 not found in the extracted packages ($1)" >&2; exit 1
}
# A binary that cannot run here (too new a glibc) fails now, not in the middle of a test.
runs() {
  "$1" "$2" >/dev/null 2>&1 && return 0
  echo "fetch-containerd: $1 does not run on this host:" >&2
  "$1" "$2" >&2 || true
  exit 1
}

runc_deb="$(download runc "$runc_suite")"
dpkg-deb -x "$runc_deb" "$cache/root/runc"
runc="$(find_tool "$cache/root/runc" runc)"
runs "$runc" --version
runc_version="$(dpkg-deb -f "$runc_deb" Version)"

for suite in "${containerd_suites[@]}"; do
  deb="$(download containerd "$suite")"
  version="$(dpkg-deb -f "$deb" Version)"
  series="$(echo "${version#*:}" | cut -d. -f1,2)"  # 1:2.1.9+ds1-5 -> 2.1
  dir="containerd-$series"
  if [ -e "$cache/$dir" ]; then
    echo "fetch-containerd: containerd $series found twice (suites ${containerd_suites[*]})" >&2
    exit 1
  fi
  tree="$cache/root/containerd-$suite"
  dpkg-deb -x "$deb" "$tree"
  mkdir -p "$cache/$dir"
  for t in containerd ctr containerd-shim-runc-v2; do
    ln -sf "$(find_tool "$tree" "$t")" "$cache/$dir/$t"
  done
  ln -sf "$runc" "$cache/$dir/runc"
  runs "$cache/$dir/containerd" --version
  runs "$cache/$dir/containerd-shim-runc-v2" -v
  echo "$dir" >> "$cache/runtimes.new"
  echo "$dir: containerd $version ($suite), runc $runc_version ($runc_suite)" >&2
done
mv "$cache/runtimes.new" "$cache/runtimes"
echo "$cache"
