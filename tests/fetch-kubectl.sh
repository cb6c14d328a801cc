#!/usr/bin/env bash
# Fetch a kubectl whose embedded kustomize renders deploy/kubernetes, for
# tests/test_deploy.py (and .ci/run, which exports its path as NRI_ACCEL_KUBECTL).
#
# usage: tests/fetch-kubectl.sh CACHE_DIR
#   Downloads Debian trixie's kubectl package (deb.debian.org, main) with a PRIVATE apt
#   configuration under CACHE_DIR/apt, as tests/e2e/fetch-containerd.sh does: the
#   system's sources, lists, package cache and preferences are neither read nor written.
#   Extracts it (dpkg -x, nothing is installed) under CACHE_DIR/root and prints the path
#   of the kubectl binary. Idempotent: once CACHE_DIR/kubectl runs, a second run prints
#   its path without touching the network.
#
#   Why trixie's kubectl (1.32, kustomize v5.5): the manifests are written for the
#   kustomize that users of supported Kubernetes versions have (kubectl 1.27+ embeds
#   kustomize v5). Bookworm's kubernetes-client is kubectl 1.20 with kustomize v2.0.3
#   (2019), which lacks `patches` and `labels` and reads fields v5 deprecates; writing for
#   it would test manifests nobody applies that way. Trixie is a stable release, so the
#   version does not move under CI as sid's would; its kubectl needs glibc 2.34, which
#   bookworm (2.36) has. The version is checked below: a kustomize older than v5 fails
#   this script, never the test half way.
#
#   export NRI_ACCEL_KUBECTL="$(tests/fetch-kubectl.sh ~/.cache/nri-accel-kubectl)"
#
# Needs apt-get, dpkg-deb and the Debian archive keyring (Debian hosts have them).
set -euo pipefail
shopt -s inherit_errexit  # a failure inside $(...) fails the script too

if [ "$#" -ne 1 ]; then
  echo "usage: $0 CACHE_DIR" >&2; exit 2
fi
mkdir -p "$1"
cache="$(cd "$1" && pwd)"
suite=trixie
min_kustomize_major=5

# The major version of the kustomize that kubectl $1 embeds ("v5.5.0" -> 5), or nothing.
kustomize_major() {
  "$1" version --client -o json 2>/dev/null \
    | sed -n 's/.*"kustomizeVersion": *"v\([0-9]*\)\..*/\1/p'
}

usable() {
  local major
  [ -x "$1" ] || return 1
  major="$(kustomize_major "$1")"
  [ -n "$major" ] && [ "$major" -ge "$min_kustomize_major" ]
}

if usable "$cache/kubectl"; then
  echo "$cache/kubectl"; exit 0
fi

keyring=/usr/share/keyrings/debian-archive-keyring.gpg
for need in apt-get dpkg-deb; do
  command -v "$need" >/dev/null || { echo "fetch-kubectl: $need not found" >&2; exit 1; }
done
[ -r "$keyring" ] || { echo "fetch-kubectl: $keyring not found (debian-archive-keyring)" >&2; exit 1; }

apt="$cache/apt"
mkdir -p "$apt/sources" "$apt/preferences" "$apt/lists/partial" "$apt/cache/archives/partial"
printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: %s\nComponents: main\nSigned-By: %s\n' \
  "$suite" "$keyring" > "$apt/sources/debian.sources"
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
rm -rf "$apt/debs" "$cache/root" "$cache/kubectl"
mkdir -p "$apt/debs"
(cd "$apt/debs" && apt-get -qq "${opts[@]}" download "kubectl/$suite" >&2)
deb="$(ls "$apt"/debs/kubectl_*.deb)"
dpkg-deb -x "$deb" "$cache/root"
[ -x "$cache/root/usr/bin/kubectl" ] || {
  echo "fetch-kubectl: usr/bin/kubectl not in $deb" >&2; exit 1; }
ln -s "$cache/root/usr/bin/kubectl" "$cache/kubectl"
if ! usable "$cache/kubectl"; then
  echo "fetch-kubectl: $deb does not give a kubectl with kustomize v$min_kustomize_major+ here:" >&2
  "$cache/kubectl" version --client >&2 || true
  rm -f "$cache/kubectl"
  exit 1
fi
echo "kubectl $(dpkg-deb -f "$deb" Version) ($suite)," \
  "kustomize v$(kustomize_major "$cache/kubectl").x" >&2
echo "$cache/kubectl"
