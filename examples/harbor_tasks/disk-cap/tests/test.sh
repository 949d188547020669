#!/bin/sh
ok=1
[ "$(cat /app/disk.txt 2>/dev/null)" = capped ] || ok=0
echo $ok > /logs/verifier/reward.txt
