#!/bin/sh
ok=1
[ "$(cat /app/answer.txt 2>/dev/null)" = compose-secret-7 ] || ok=0
echo $ok > /logs/verifier/reward.txt
