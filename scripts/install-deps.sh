#!/bin/sh
# install-deps.sh: installs the Debian packages petrel builds against, if any is missing.
# Runs apt-get directly as root, through sudo otherwise; says what it does and why.
set -e
PKGS="gcc make libcjson-dev libpcre2-dev libutf8proc-dev liburing-dev libxxhash-dev libmicrohttpd-dev zlib1g-dev"
missing=""
for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
# Test clients (npm): the official `openai` package for the `petrel serve` black-box test, into
# the ignored tests/node/node_modules. Optional: without npm or the registry the test is skipped
# with its reason, so a failure here warns and does not stop the build.
if command -v npm >/dev/null 2>&1 && [ ! -d tests/node/node_modules/openai ]; then
    echo "petrel: installing the npm test clients (tests/node: openai) for the serve tests" >&2
    npm install --prefix tests/node --no-audit --no-fund --loglevel=error >/dev/null 2>&1 ||
        echo "petrel: npm install in tests/node failed: the openai client test will be skipped" >&2
fi
[ -z "$missing" ] && exit 0
echo "petrel: installing missing Debian packages:$missing" >&2
if [ "$(id -u)" = 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null 2>&1; then
    echo "petrel: not root, using sudo (you may be asked for your password)" >&2
    SUDO="sudo"
else
    echo "petrel: need root or sudo to install:$missing" >&2
    echo "petrel: run as root: apt-get install -y$missing" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y --no-install-recommends $missing >/dev/null 2>&1 || {
    $SUDO apt-get update >/dev/null
    $SUDO apt-get install -y --no-install-recommends $missing
}
