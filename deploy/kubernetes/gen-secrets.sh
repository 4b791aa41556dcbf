#!/usr/bin/env bash
# Writes what the base's secretGenerator reads into deploy/kubernetes/base/secrets/ (ignored by
# git): a private CA (ca.crt), one certificate and key that every pdserve process serves and
# presents to the others (tls.crt, tls.key), and a random bearer token (auth-token).
#
#   deploy/kubernetes/gen-secrets.sh [NAMESPACE]          # default namespace: pdserve
#
# The certificate names the gateway's Service (pdserve-gateway[.NAMESPACE[.svc[.cluster.local]]])
# and "pdserve-worker", the name the gateway and decode workers expect from workers, which they
# reach by pod IP (--tls-server-name). Existing files are kept: delete them to rotate. To use
# your own PKI, put your files under these names instead. Needs openssl.
set -euo pipefail
namespace=${1:-pdserve}
out=${PDSERVE_SECRETS_DIR:-"$(cd "$(dirname "$0")" && pwd)/base/secrets"}
mkdir -p "$out"
cd "$out"
umask 077
if [ ! -f ca.crt ] || [ ! -f tls.crt ] || [ ! -f tls.key ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  cat > "$work/openssl.cnf" <<CNF
[req]
distinguished_name = dn
[dn]
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[leaf]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = DNS:pdserve-worker, DNS:pdserve-gateway, DNS:pdserve-gateway.${namespace}, DNS:pdserve-gateway.${namespace}.svc, DNS:pdserve-gateway.${namespace}.svc.cluster.local, DNS:localhost, IP:127.0.0.1
CNF
  newkey=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -config "$work/openssl.cnf")
  openssl req -x509 "${newkey[@]}" -keyout "$work/ca.key" -out ca.crt -days 825 \
    -subj "/CN=pdserve CA" -extensions ca 2>/dev/null
  openssl req -new "${newkey[@]}" -keyout tls.key -out "$work/tls.csr" -subj "/CN=pdserve" 2>/dev/null
  openssl x509 -req -in "$work/tls.csr" -CA ca.crt -CAkey "$work/ca.key" -CAcreateserial \
    -CAserial "$work/ca.srl" -days 825 -out tls.crt -extfile "$work/openssl.cnf" -extensions leaf 2>/dev/null
  # The CA's key is not kept: issue a new set (delete these files) to rotate.
fi
if [ ! -f auth-token ]; then
  openssl rand -hex 32 | tr -d '\n' > auth-token
fi
echo "pdserve secrets in $out: ca.crt tls.crt tls.key auth-token"
