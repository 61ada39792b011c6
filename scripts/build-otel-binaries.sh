#!/usr/bin/env bash
# Build the Go binaries that otel_verl's collector tests and local stack use,
# from source through the Go module proxy (never prebuilt downloads):
#
#   jaeger   Jaeger v2.13 (Go module github.com/jaegertracing/jaeger v1.76.0, cmd/jaeger)
#   otelcol  minimal OpenTelemetry Collector from scripts/otelcol (go.mod/go.sum pinned):
#            otlp + otlp_json_file receivers, batch + resource + tail_sampling
#            processors, debug/otlp_grpc/otlp_http/file/prometheus/loadbalancing/clickhouse
#            exporters
#
# A binary is built only when it is missing from the cache dir
#   ${OTEL_VERL_BIN_CACHE:-$HOME/.cache/otel_verl/bin}
# (delete it, or pass --force, to rebuild), or, for otelcol, when its sources
# changed (otelcol.sources there holds the sha256 of scripts/otelcol's go.mod,
# go.sum and main.go that it was built from). Go's module and build caches are the
# defaults (~/go/pkg/mod, ~/.cache/go-build), so a CI cache of those makes
# rebuilds take seconds.
#
# Usage: scripts/build-otel-binaries.sh [--print-dir] [--force] [jaeger|otelcol ...]
# Env:   OTEL_VERL_BIN_CACHE  output dir
#        OTEL_VERL_SRC_CACHE  work dir for the jaeger wrapper module (default ~/.cache/otel_verl/src)
#        OTEL_VERL_GO_BUILD_FLAGS  extra `go build` flags (e.g. "-p=1" on small machines)
# Needs Go >= 1.26 (scripts/otelcol/go.mod says `go 1.26.0`: collector v0.161 requires it).
set -euo pipefail

JAEGER_MODULE=github.com/jaegertracing/jaeger
JAEGER_VERSION=v1.76.0   # == Jaeger v2.13.0 (Jaeger keeps v1.x tags for Go modules)
JAEGER_V2_VERSION=v2.13.0 # reported by `jaeger version`

BIN_DIR="${OTEL_VERL_BIN_CACHE:-$HOME/.cache/otel_verl/bin}"
SRC_DIR="${OTEL_VERL_SRC_CACHE:-$HOME/.cache/otel_verl/src}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

die() { echo "build-otel-binaries: error: $*" >&2; exit 1; }
log() { echo "build-otel-binaries: $*" >&2; }

force=0
targets=()
for arg in "$@"; do
  case "$arg" in
    --print-dir) echo "$BIN_DIR"; exit 0 ;;
    --force) force=1 ;;
    jaeger|otelcol) targets+=("$arg") ;;
    -h|--help) sed -n '2,23s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) die "unknown argument: $arg (expected --print-dir, --force, jaeger, otelcol)" ;;
  esac
done
[[ ${#targets[@]} -gt 0 ]] || targets=(jaeger otelcol)

command -v go >/dev/null 2>&1 ||
  die "'go' not found on PATH; install Go >= 1.26 (collector v0.161 needs it; Jaeger needs >= 1.24.6) and retry"
mkdir -p "$BIN_DIR" "$SRC_DIR"
# One build at a time (CI's background build, tests that need a binary): a later caller
# waits, then finds the binary built. OTEL_VERL_BUILD_LOCKED: the caller holds the lock.
if [[ -z "${OTEL_VERL_BUILD_LOCKED:-}" ]] && command -v flock >/dev/null 2>&1; then
  exec 9>"$BIN_DIR/.build.lock"
  flock 9
fi

export CGO_ENABLED=0
# shellcheck disable=SC2206
extra=(${OTEL_VERL_GO_BUILD_FLAGS:-})

# go_build OUT PKG [LDFLAGS]: build into a temp file, then rename, so an
# interrupted build never leaves a half-written binary that later runs trust.
# -s -w drops the symbol table and DWARF (about a third of the size).
go_build() {
  local out="$1" pkg="$2" ldflags="-s -w ${3:-}" start=$SECONDS
  go build -trimpath -ldflags="$ldflags" "${extra[@]}" -o "$out.tmp.$$" "$pkg" ||
    { rm -f "$out.tmp.$$"; return 1; }
  mv -f "$out.tmp.$$" "$out"
  log "built $out in $((SECONDS - start))s ($(du -h "$out" | cut -f1))"
}

build_jaeger() {
  # `go install github.com/jaegertracing/jaeger/cmd/jaeger@v1.76.0` is refused:
  #   "The go.mod file for the module providing named packages contains one or
  #    more replace directives." (replace github.com/Shopify/sarama => v1.33.0)
  # so build through a wrapper module that repeats that replace.
  local w="$SRC_DIR/jaeger"
  mkdir -p "$w"
  cd "$w" || return 1
  if ! grep -q "$JAEGER_MODULE $JAEGER_VERSION" go.mod 2>/dev/null; then
    rm -f go.mod go.sum
    go mod init local/jaegerbin 2>/dev/null || return 1
    go mod edit -replace=github.com/Shopify/sarama=github.com/Shopify/sarama@v1.33.0 || return 1
    go get -tool "$JAEGER_MODULE/cmd/jaeger@$JAEGER_VERSION" || return 1
  fi
  go_build "$BIN_DIR/jaeger" "$JAEGER_MODULE/cmd/jaeger" \
    "-X $JAEGER_MODULE/internal/version.latestVersion=$JAEGER_V2_VERSION"
}

# otelcol_sources: the sha256 of what the otelcol binary is built from
# (tests/otel_binaries.py computes the same to find a stale binary).
otelcol_sources() {
  (cd "$REPO_ROOT/scripts/otelcol" && cat go.mod go.sum main.go | sha256sum | cut -d' ' -f1)
}

build_otelcol() {
  # go.mod/go.sum in scripts/otelcol pin every module; -mod=readonly makes the
  # build fail rather than silently resolve something else.
  local sources
  sources="$(otelcol_sources)" || return 1
  cd "$REPO_ROOT/scripts/otelcol" || return 1
  extra+=(-mod=readonly)
  go_build "$BIN_DIR/otelcol" . || return 1
  echo "$sources" > "$BIN_DIR/otelcol.sources"
}

# up_to_date NAME: the cached binary exists and was built from today's sources
up_to_date() {
  [[ -x "$BIN_DIR/$1" ]] || return 1
  [[ "$1" != otelcol ]] && return 0
  [[ "$(cat "$BIN_DIR/otelcol.sources" 2>/dev/null)" == "$(otelcol_sources)" ]]
}

for t in "${targets[@]}"; do
  if [[ $force -eq 0 ]] && up_to_date "$t"; then
    log "$t already built: $BIN_DIR/$t"
  else
    log "building $t (cold builds take minutes) ..."
    # a subshell keeps cd/extra local; `|| die` turns any failure into a message
    ("build_$t") || die "building $t failed (see the go output above)"
  fi
done
for t in "${targets[@]}"; do echo "$BIN_DIR/$t"; done
