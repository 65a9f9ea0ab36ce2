#!/usr/bin/env bash
# On the GPU machine: wait up to WAIT_S seconds (less once every started leaderboard is DONE),
# packing every worker folder of /tmp/lb into $OUT/lb.tgz each minute and at the end (a call
# returns at most 8 files, and one cut short by the session's budget still returns the last pack),
# then print each folder's cell count and any error lines. A call of this holds the machine while
# jobs run; on a machine where nothing was started (a fresh one, after a loss) it stops at once.
#   bash benchmarks/device/collect.sh WAIT_S
[ -d /tmp/lb ] || { echo "no /tmp/lb on this machine: nothing was started here (a fresh machine?)"; exit 1; }
pack() { (cd /tmp/lb && tar czf "$OUT/lb.tgz.new" */ && mv "$OUT/lb.tgz.new" "$OUT/lb.tgz"); }
end=$((SECONDS + ${1:-0})) next=0
while [ $SECONDS -lt $end ]; do
  started=$(ls -d /tmp/lb/*/ 2>/dev/null | wc -l) done=$(ls /tmp/lb/*/DONE 2>/dev/null | wc -l)
  [ "$started" -gt 0 ] && [ "$started" -eq "$done" ] && break
  [ $SECONDS -ge $next ] && pack && next=$((SECONDS + 60))
  sleep 10
done
pack
for f in /tmp/lb/*/c*/cells.jsonl; do [ -f "$f" ] && echo "$(wc -l < "$f") $f"; done
ls /tmp/lb/*/DONE 2>/dev/null
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
grep -h -i -E "error|Traceback|Killed|out of memory" /tmp/lb/*/profile.log /tmp/lb/*/c*/log 2>/dev/null | sort | uniq -c | head
