#!/bin/sh
ok=1
[ "$(cat /app/out.txt 2>/dev/null)" = needle-42 ] || ok=0
echo $ok > /logs/verifier/reward.txt
