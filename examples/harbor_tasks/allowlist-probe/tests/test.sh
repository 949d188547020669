#!/bin/sh
ok=1
[ "$(cat /app/net.txt 2>/dev/null)" = refused ] || ok=0
echo $ok > /logs/verifier/reward.txt
