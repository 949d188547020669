#!/bin/sh
ok=1
[ "$(cat /app/apples.txt 2>/dev/null)" = 7 ] || ok=0
echo $ok > /logs/verifier/reward.txt
