#!/usr/bin/env bash
# Fetch a real containerd with its embedded NRI (Debian trixie's 1.7.24) and runc, for the
# end-to-end test tests/e2e/test_containerd.py.
#
# usage: tests/e2e/fetch-containerd.sh CACHE_DIR
#   Downloads containerd from trixie and runc from bookworm (deb.debian.org, main) with a
#   PRIVATE apt configuration under CACHE_DIR/apt: the system's sources, lists, package
#   cache and preferences are neither read nor written. Extracts them (dpkg -x, nothing is
#   installed) into CACHE_DIR/root and prints CACHE_DIR/bin, a directory holding
#   containerd, ctr, containerd-shim-runc-v2 and runc. Idempotent: once CACHE_DIR/bin is
#   complete, a second run prints it without touching the network.
#
#   Why runc from bookworm: trixie's runc needs glibc 2.38, bookworm hosts (this project's
#   CI image) have 2.36; containerd's own binaries need only glibc 2.34. Bookworm's runc
#   (1.1.x, which containerd 1.7 supports) runs on bookworm and anything newer.
#
#   export NRI_ACCEL_E2E_BIN="$(tests/e2e/fetch-containerd.sh ~/.cache/nri-accel-e2e)"
#
# Needs apt-get, dpkg and the Debian archive keyring (Debian hosts have them; elsewhere,
# install debian-archive-keyring). Uses the host's architecture (amd64, arm64, ...).
set -euo pipefail

if [ "$#" -ne 1 ]; then
  echo "usage: $0 CACHE_DIR" >&2; exit 2
fi
mkdir -p "$1"
cache="$(cd "$1" && pwd)"
bin="$cache/bin"
tools=(containerd ctr containerd-shim-runc-v2 runc)

complete() {
  local t
  for t in "${tools[@]}"; do [ -x "$bin/$t" ] || return 1; done
  [ -s "$cache/versions" ]
}

if complete; then
  echo "$bin"; exit 0
fi

keyring=/usr/share/keyrings/debian-archive-keyring.gpg
for need in apt-get dpkg dpkg-deb; do
  command -v "$need" >/dev/null || { echo "fetch-containerd: $need not found" >&2; exit 1; }
done
[ -r "$keyring" ] || { echo "fetch-containerd: $keyring not found (debian-archive-keyring)" >&2; exit 1; }

apt="$cache/apt"
mkdir -p "$apt/sources" "$apt/preferences" "$apt/lists/partial" "$apt/cache/archives/partial"
printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: trixie bookworm\nComponents: main\nSigned-By: %s\n' \
  "$keyring" > "$apt/sources/trixie.sources"
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
rm -f "$apt"/debs/*.deb
mkdir -p "$apt/debs"
(cd "$apt/debs" && apt-get -qq "${opts[@]}" download containerd/trixie runc/bookworm >&2)

rm -rf "$cache/root" "$bin"
: > "$cache/versions.new"
for deb in "$apt"/debs/*.deb; do
  dpkg-deb -x "$deb" "$cache/root"
  dpkg-deb -W --showformat='${Package} ${Version}\n' "$deb" >> "$cache/versions.new"
done
mkdir -p "$bin"
for t in "${tools[@]}"; do
  found=""
  for dir in usr/bin usr/sbin bin sbin; do
    if [ -x "$cache/root/$dir/$t" ]; then found="$cache/root/$dir/$t"; break; fi
  done
  [ -n "$found" ] || { echo "fetch-containerd: $t not found in the extracted packages" >&2; exit 1; }
  ln -sf "$found" "$bin/$t"
done
# A binary that cannot run here (too new a glibc) fails now, not in the middle of a test.
runs() {
  "$bin/$1" "$2" >/dev/null 2>&1 && return 0
  echo "fetch-containerd: $bin/$1 does not run on this host:" >&2
  "$bin/$1" "$2" >&2 || true
  exit 1
}
runs containerd --version
runs runc --version
runs containerd-shim-runc-v2 -v
mv "$cache/versions.new" "$cache/versions"
cat "$cache/versions" >&2
echo "$bin"
