#!/usr/bin/env bash
# Sourced first by the device scripts: the commit every results file records. A device call runs on a copy of the
# working tree whose git metadata can be older than its files, so `git rev-parse HEAD` there may name another
# commit; the caller writes the full hash of the committed tree out instead:
#   SNAPQUANT_GIT_COMMIT=<40-character hash of HEAD> bash scripts/device_<...>.sh
# A CPU smoke run (SMOKE=1) records "smoke" when none is given.
if [ -n "${SMOKE:-}" ] && [ -z "${SNAPQUANT_GIT_COMMIT:-}" ]; then
  export SNAPQUANT_GIT_COMMIT=smoke
elif [[ ! "${SNAPQUANT_GIT_COMMIT:-}" =~ ^[0-9a-f]{40}$ ]]; then
  echo "SNAPQUANT_GIT_COMMIT must be the full 40-character hash of the committed tree, written out" \
       "(got '${SNAPQUANT_GIT_COMMIT:-}'); the copy's own git metadata may be stale" >&2
  exit 2
else
  export SNAPQUANT_GIT_COMMIT
fi
