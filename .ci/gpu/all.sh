#!/usr/bin/env bash
# Every phase in order (about 19 minutes: longer than one 10-minute device call, so on the
# device tool run the phases in separate calls).
cd "$(dirname "$0")"
rc=0
for p in env correctness sanitizers performance profile python; do bash "$p.sh" || rc=1; done
exit $rc
