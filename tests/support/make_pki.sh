#!/usr/bin/env bash
# make_pki.sh: a private PKI for the TLS tests, made with the openssl command:
# the one certificate maker of the C++ (support/certificates.h), Python and
# Node tests.
#
#   make_pki.sh DIR CA... -- NAME/CA/HOSTS/NOT_BEFORE/NOT_AFTER...
#
# Each CA gets a self-signed DIR/CA.crt and DIR/CA.key; each NAME a
# DIR/NAME.crt and DIR/NAME.key signed by its CA, with the subjectAltName
# HOSTS (e.g. DNS:localhost,IP:127.0.0.1; empty for a client certificate) and
# the validity NOT_BEFORE..NOT_AFTER (YYYYMMDDHHMMSSZ; empty: 2020..2099).
# A "/" inside HOSTS (a URI name such as URI:spiffe://test/bob) is written
# %2F, since "/" separates the fields.
# Certificates are signed with `openssl ca`, which can back-date them, so
# expired and not-yet-valid certificates are as easy to make as valid ones.
# openssl's output goes to DIR/openssl.log.
set -euo pipefail
dir=$1
shift
cd "$dir"
exec 3>>openssl.log 1>&3 2>&3
key=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)
while (($#)) && [[ $1 != -- ]]; do
  ca=$1
  shift
  openssl req -x509 "${key[@]}" -keyout "$ca.key" -out "$ca.crt" -days 2 -subj "/CN=$ca"
  mkdir "$ca.db"
  : >"$ca.db/index.txt"
  echo 01 >"$ca.db/serial"
  printf '[ca]\ndefault_ca=signer\n[signer]\ndatabase=%s.db/index.txt\nnew_certs_dir=%s.db\nserial=%s.db/serial\ndefault_md=sha256\npolicy=anything\nunique_subject=no\n[anything]\ncommonName=supplied\n' \
    "$ca" "$ca" "$ca" >"$ca.cnf"
done
(($#)) && shift
for spec in "$@"; do
  IFS=/ read -r name ca hosts not_before not_after _ <<<"$spec/////"
  hosts=${hosts//%2F//}
  {
    echo "basicConstraints=CA:FALSE"
    [[ -z $hosts ]] || echo "subjectAltName=$hosts"
  } >"$name.ext"
  openssl req "${key[@]}" -keyout "$name.key" -out "$name.csr" -subj "/CN=$name"
  openssl ca -batch -config "$ca.cnf" -cert "$ca.crt" -keyfile "$ca.key" -in "$name.csr" \
    -out "$name.crt" -extfile "$name.ext" -startdate "${not_before:-20200101000000Z}" \
    -enddate "${not_after:-20991231000000Z}"
done
