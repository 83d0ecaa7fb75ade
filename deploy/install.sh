#!/bin/sh
# Install llama-guard on a systemd host: a virtualenv under /opt/llama-guard, the configuration
# in /etc/llama-guard, the units in /etc/systemd/system, the journal message catalog, and the
# unprivileged system user llama-server (groups video, render) that llama-guard starts
# llama-server as. llama-guard itself runs as root with a bounded capability set (GPU resets;
# see docs/systemd.md).
#
#   sudo deploy/install.sh                 # from a checkout of llama-guard
#   sudo PYTHON=python3.11 deploy/install.sh
#
# Environment: PREFIX (default /opt/llama-guard), PYTHON (default python3), DESTDIR (stage into a
# directory instead of /; skips user creation, pip and systemctl), SKIP_VENV=1 (keep the venv).
# An existing /etc/llama-guard/llama-guard.toml is never overwritten. Re-running upgrades.
set -eu

SRC=$(cd "$(dirname "$0")/.." && pwd)
PREFIX=${PREFIX:-/opt/llama-guard}
PYTHON=${PYTHON:-python3}
DESTDIR=${DESTDIR:-}
SKIP_VENV=${SKIP_VENV:-}
# [server].user / group of etc/llama-guard.toml (a test checks they agree).
SERVER_USER=llama-server

say() { printf 'install.sh: %s\n' "$*"; }
die() { printf 'install.sh: error: %s\n' "$*" >&2; exit 1; }

if [ -z "$DESTDIR" ] && [ "$(id -u)" -ne 0 ]; then
    die "run as root (or set DESTDIR to stage the files)"
fi
[ -f "$SRC/pyproject.toml" ] || die "$SRC is not a llama-guard checkout"

# --- user and groups -----------------------------------------------------------------------
if [ -z "$DESTDIR" ]; then
    for g in video render; do
        getent group "$g" >/dev/null || { say "creating group $g"; groupadd --system "$g"; }
    done
    if ! getent passwd "$SERVER_USER" >/dev/null; then
        say "creating system user $SERVER_USER (llama-server runs as it, without capabilities)"
        useradd --system --user-group --home-dir /nonexistent --no-create-home \
            --shell /usr/sbin/nologin --groups video,render --comment "llama-server under llama-guard" \
            "$SERVER_USER"
    else
        usermod --append --groups video,render "$SERVER_USER"
    fi
    OWNER="root:root"
    SERVER_READS="root:$SERVER_USER"
else
    OWNER=""
    SERVER_READS=""
fi

own() {  # own OWNER PATH: chown when installing for real
    [ -n "$1" ] && chown "$1" "$2"
    return 0
}

# --- virtualenv ----------------------------------------------------------------------------
if [ -z "$DESTDIR" ] && [ -z "$SKIP_VENV" ]; then
    say "virtualenv $PREFIX ($PYTHON)"
    [ -x "$PREFIX/bin/python" ] || "$PYTHON" -m venv "$PREFIX"
    "$PREFIX/bin/pip" install --quiet --upgrade pip
    "$PREFIX/bin/pip" install --quiet --upgrade "$SRC"
    "$PREFIX/bin/llama-guard" --help >/dev/null || die "$PREFIX/bin/llama-guard does not run"
fi
install -d -m 0755 "$DESTDIR$PREFIX/share/doc/llama-guard"
install -m 0644 "$SRC/docs/systemd.md" "$DESTDIR$PREFIX/share/doc/llama-guard/systemd.md"

# --- configuration -------------------------------------------------------------------------
# The directory is searchable by $SERVER_USER (for an api_key_file here, root:$SERVER_USER 0640);
# the config itself is root's only.
install -d -m 0750 "$DESTDIR/etc/llama-guard"
own "$SERVER_READS" "$DESTDIR/etc/llama-guard"
if [ -e "$DESTDIR/etc/llama-guard/llama-guard.toml" ]; then
    say "keeping /etc/llama-guard/llama-guard.toml; the shipped one is llama-guard.toml.dist"
    install -m 0640 "$SRC/etc/llama-guard.toml" "$DESTDIR/etc/llama-guard/llama-guard.toml.dist"
    own "$OWNER" "$DESTDIR/etc/llama-guard/llama-guard.toml.dist"
else
    install -m 0640 "$SRC/etc/llama-guard.toml" "$DESTDIR/etc/llama-guard/llama-guard.toml"
    own "$OWNER" "$DESTDIR/etc/llama-guard/llama-guard.toml"
fi
# State: root's; models readable by $SERVER_USER.
install -d -m 0755 "$DESTDIR/var/lib/llama-guard"
install -d -m 0750 "$DESTDIR/var/lib/llama-guard/models"
own "$SERVER_READS" "$DESTDIR/var/lib/llama-guard/models"

# --- units and journal catalog -------------------------------------------------------------
install -d -m 0755 "$DESTDIR/etc/systemd/system" "$DESTDIR/usr/local/lib/systemd/catalog"
for unit in "$SRC"/deploy/systemd/*.service "$SRC"/deploy/systemd/*.socket; do
    sed "s#/opt/llama-guard/#$PREFIX/#g" "$unit" > "$DESTDIR/etc/systemd/system/$(basename "$unit")"
    chmod 0644 "$DESTDIR/etc/systemd/system/$(basename "$unit")"
done
install -m 0644 "$SRC/deploy/journald/llama-guard.catalog" \
    "$DESTDIR/usr/local/lib/systemd/catalog/llama-guard.catalog"

if [ -z "$DESTDIR" ]; then
    journalctl --update-catalog || say "journalctl --update-catalog failed (catalog not indexed)"
    systemctl daemon-reload || say "systemctl daemon-reload failed (no systemd as PID 1?): the units are installed; \
run llama-guard under your own supervisor with: $PREFIX/bin/llama-guard run"
fi

cat <<MSG
install.sh: done. Next:
  1. put the model in /var/lib/llama-guard/models (readable by $SERVER_USER) and edit
     /etc/llama-guard/llama-guard.toml ([server].binary, model; api_key_file for a non-loopback host:
     install -m 0640 -o root -g $SERVER_USER KEYFILE /etc/llama-guard/api-key)
  2. $PREFIX/bin/llama-guard check --config /etc/llama-guard/llama-guard.toml
  3. systemctl enable --now llama-guard.socket llama-guard
     (the socket keeps clients' connections waiting while llama-guard itself restarts; its
     ListenStream= must be [front].listen)
     (one per GPU instead: /etc/llama-guard/N.toml and systemctl enable --now llama-guard@N)
  4. journalctl -u llama-guard -f
MSG
