#!/bin/sh
ok=1
[ "$(cat /app/count.txt 2>/dev/null)" = 9 ] || ok=0
echo $ok > /logs/verifier/reward.txt
