#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck over every kernel at a small shape (tools/sanitize_targets.py).
set -u
rc=0
for tool in memcheck racecheck; do
  echo "== $tool =="
  compute-sanitizer --tool "$tool" --error-exitcode 3 --print-limit 20 python3 tools/sanitize_targets.py || rc=$?
done
exit $rc
