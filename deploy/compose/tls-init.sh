#!/bin/sh
# The compose stack's certificates, as the Kubernetes Secrets hold them (docs/deploy.md, "Compose: TLS"):
# a CA of this stack in $KVFERRY_TLS_ROOT/ca (volume tls-ca, which only this one-shot service mounts) and,
# for each identity, tls.crt, tls.key and ca.crt in $KVFERRY_TLS_ROOT/<folder> (its own volume, mounted only
# by the services that are that identity). The common name is the identity's registry role
# (docs/security.md): registry, router, engine:<engine-id>; engines also get the SPIFFE-style URI SAN.
#
# Arguments, one per identity: "FOLDER COMMON-NAME EXTENDED-KEY-USAGES SAN..." (SANs as openssl writes them:
# DNS:name, IP:address, URI:spiffe://...). It runs at every `docker compose up` and keeps what is still good:
# a certificate is issued again when it is missing, was asked with other names or usages, is not from this
# CA, or has less than 30 days left. The services take a new one up without a restart.
# The openssl command comes with the image (Debian's ca-certificates depends on it).
set -eu

root=${KVFERRY_TLS_ROOT:-/tls}
days=${KVFERRY_TLS_DAYS:-397}
# Who reads the files: the kvferry image's user (etcd runs as root and reads them too).
owner=${KVFERRY_TLS_OWNER:-10001:10001}
command -v openssl >/dev/null || { echo "tls-init: needs the openssl command" >&2; exit 1; }
umask 077
work=""
trap '[ -z "$work" ] || rm -rf "$work"' EXIT

ca=$root/ca
mkdir -p "$ca"
if [ ! -s "$ca/ca.key" ] || [ ! -s "$ca/ca.crt" ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 3650 \
    -subj "/CN=kvferry compose CA" -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" -keyout "$ca/ca.key" -out "$ca/ca.crt" 2>/dev/null
  echo "tls-init: made a new CA"
fi

for identity in "$@"; do
  # Split the argument into words (no globbing: a SAN is never a pattern).
  set -f
  # shellcheck disable=SC2086
  set -- $identity
  set +f
  if [ $# -lt 4 ]; then
    echo "tls-init: expected 'FOLDER COMMON-NAME USAGES SAN...', got '$identity'" >&2
    exit 2
  fi
  folder=$1 name=$2 usages=$3
  shift 3
  sans=$(printf '%s\n' "$@" | paste -sd, -)
  request="$name $usages $sans"
  dir=$root/$folder
  mkdir -p "$dir"
  if [ -s "$dir/tls.crt" ] && [ -s "$dir/tls.key" ] && [ "$(cat "$dir/request" 2>/dev/null)" = "$request" ] &&
    openssl verify -CAfile "$ca/ca.crt" "$dir/tls.crt" >/dev/null 2>&1 &&
    openssl x509 -checkend 2592000 -noout -in "$dir/tls.crt" >/dev/null; then
    echo "tls-init: $folder ($name) kept"
    continue
  fi
  work=$(mktemp -d "$dir/.new.XXXXXX")
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$name" \
    -keyout "$work/tls.key" -out "$work/tls.csr" 2>/dev/null
  printf 'basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=%s\nsubjectAltName=%s\n' \
    "$usages" "$sans" >"$work/tls.ext"
  openssl x509 -req -in "$work/tls.csr" -CA "$ca/ca.crt" -CAkey "$ca/ca.key" \
    -set_serial "0x$(openssl rand -hex 16)" -days "$days" -extfile "$work/tls.ext" -out "$work/tls.crt" 2>/dev/null
  cp "$ca/ca.crt" "$work/ca.crt"
  printf '%s\n' "$request" >"$work/request"
  if [ "$(id -u)" = 0 ]; then
    chown "$owner" "$work/tls.key" "$work/tls.crt" "$work/ca.crt"
  fi
  chmod 0600 "$work/tls.key"
  chmod 0644 "$work/tls.crt" "$work/ca.crt"
  # Each file is replaced whole (rename); a reader may see the new certificate before its key for a
  # moment, keeps its last good pair meanwhile, and takes the pair up at the next change.
  for file in ca.crt tls.key tls.crt request; do
    mv -f "$work/$file" "$dir/$file"
  done
  rm -rf "$work"
  work=""
  echo "tls-init: $folder ($name) issued: $sans"
done
