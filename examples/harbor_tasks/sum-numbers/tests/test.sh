#!/bin/sh
ok=1
[ "$(cat /app/sum.txt 2>/dev/null)" = 35350 ] || ok=0
echo $ok > /logs/verifier/reward.txt
