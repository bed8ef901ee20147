#!/usr/bin/env bash
# Screenshots of the docs site as a reader sees it, for a person to look at before calling a docs
# change done. Run by hand, not in CI (it needs a browser):
#   apt-get install -y chromium          # Debian's package; CHROMIUM=... names another binary
#   PYTHON=/path/to/venv/bin/python bash .ci/screenshots.sh [OUT_DIR]
# It builds the site (mkdocs build --strict), serves it on 127.0.0.1 on a free port, and renders
# with headless Chromium, with every host but 127.0.0.1 unreachable (an air-gapped reader: what
# needs a CDN shows as missing):
#   home.png, api.png             the home page and the API reference, first screen (1280x900)
#   home-long.png, api-long.png   the same, the first 5000 pixels (the diagrams; docstrings,
#                                 links and examples): zoom in, or crop
# (Headless Chromium's --screenshot draws a blank page when the URL has an #anchor, hence the
# long shots.)
# PNGs go to OUT_DIR (default: a new temporary folder); never commit them.
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-python3}"
chromium="${CHROMIUM:-chromium}"
width="${WIDTH:-1280}"
out="${1:-$(mktemp -d)}"
mkdir -p "$out"
work="$(mktemp -d)"
server_pid=""
cleanup() {
    if [[ -n "$server_pid" ]]; then kill "$server_pid" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

NO_MKDOCS_2_WARNING=1 "$python" -m mkdocs build --strict --quiet --site-dir "$work/site"

# Bind port 0 (the OS picks a free port) and report it, so two runs never collide.
"$python" -c '
import functools, http.server, sys
handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=sys.argv[1])
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
print(server.server_port, flush=True)
server.serve_forever()
' "$work/site" >"$work/port" 2>"$work/server.log" &
server_pid=$!
for _ in $(seq 50); do
    [[ -s "$work/port" ]] && break
    sleep 0.1
done
port="$(cat "$work/port")"

shot() {  # shot FILE HEIGHT PATH
    "$chromium" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
        --disable-background-networking --disable-component-update --disable-sync \
        --host-resolver-rules="MAP * ~NOTFOUND, EXCLUDE 127.0.0.1" \
        --hide-scrollbars --virtual-time-budget=5000 \
        --user-data-dir="$work/profile" --window-size="$width,$2" \
        --screenshot="$out/$1" "http://127.0.0.1:$port/$3" >"$work/chromium.log" 2>&1 ||
        { cat "$work/chromium.log" >&2; exit 1; }
    echo "$out/$1"
}
shot home.png 900 ""
shot home-long.png 5000 ""
shot api.png 900 "api/"
shot api-long.png 5000 "api/"
