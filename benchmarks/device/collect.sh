#!/usr/bin/env bash
# On the GPU machine: wait up to WAIT_S seconds (less once every started leaderboard is DONE), then
# pack every worker folder of /tmp/lb into $OUT/lb.tgz (a call returns at most 8 files) and print
# each folder's cell count and any error lines. A call of this holds the machine while jobs run.
#   bash benchmarks/device/collect.sh WAIT_S
end=$((SECONDS + ${1:-0}))
while [ $SECONDS -lt $end ]; do
  started=$(ls -d /tmp/lb/*/ 2>/dev/null | wc -l) done=$(ls /tmp/lb/*/DONE 2>/dev/null | wc -l)
  [ "$started" -gt 0 ] && [ "$started" -eq "$done" ] && break
  sleep 10
done
cd /tmp/lb && tar czf "$OUT/lb.tgz" */
for f in /tmp/lb/*/c*/cells.jsonl; do [ -f "$f" ] && echo "$(wc -l < "$f") $f"; done
ls /tmp/lb/*/DONE 2>/dev/null
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
grep -h -i -E "error|Traceback|Killed|out of memory" /tmp/lb/*/profile.log /tmp/lb/*/c*/log 2>/dev/null | sort | uniq -c | head
