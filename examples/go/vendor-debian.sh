#!/usr/bin/env bash
# Offline build: fills vendor/ with the modules go.mod requires, from Debian's packaged Go
# sources, so that `go build -mod=vendor` needs no module proxy.
#
#   apt-get install golang-go golang-github-gomodule-redigo-dev \
#     golang-github-vmihailenco-msgpack.v5-dev
#   ./vendor-debian.sh && GOFLAGS=-mod=vendor go build -o redbatch-client . && ./redbatch-client "a text"
#   env: GOCODE (/usr/share/gocode/src, where Debian's golang-*-dev packages put the sources)
#
# vendor/modules.txt records the versions go.mod asks for; go.mod pins the versions Debian 12
# ships, so the offline build compiles the same code as `go mod tidy && go build` online.
set -euo pipefail
cd "$(dirname "$0")"
gocode=${GOCODE:-/usr/share/gocode/src}

rm -rf vendor
mkdir vendor
# "path version" for every requirement of go.mod (block and single-line forms)
requirements=$(awk '/^require \($/ {block = 1; next}
                    block && /^\)/ {block = 0; next}
                    block {print $1, $2; next}
                    /^require [^(]/ {print $2, $3}' go.mod)
[ -n "$requirements" ] || { echo "vendor-debian: go.mod requires nothing" >&2; exit 1; }

while read -r path version; do
  source="$gocode/$path"
  if [ ! -f "$source/go.mod" ]; then
    echo "vendor-debian: $path is not under $gocode: install its golang-*-dev package" >&2
    exit 1
  fi
  # like `go mod vendor`: the packages and their licences, without tests or nested go.mod
  mkdir -p "vendor/$(dirname "$path")"
  cp -R "$source" "vendor/$path"
  find "vendor/$path" \( -name '*_test.go' -o -name 'go.mod' -o -name 'go.sum' \) -type f -delete
  find "vendor/$path" -depth -type d -name testdata -exec rm -rf {} +
  go_version=$(awk '$1 == "go" {print $2}' "$source/go.mod")
  {
    echo "# $path $version"
    echo "## explicit${go_version:+; go $go_version}"
    find "vendor/$path" -name '*.go' -printf '%h\n' | sed 's|^vendor/||' | sort -u
  } >> vendor/modules.txt
  if command -v dpkg-query >/dev/null 2>&1; then
    package=$(dpkg-query -S "$source" 2>/dev/null | cut -d: -f1 || true)
    [ -z "$package" ] || echo "vendor-debian: $path $version from $package" \
      "$(dpkg-query -W -f '${Version}' "$package")" >&2
  fi
done <<< "$requirements"
