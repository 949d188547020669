#!/bin/sh
ok=1
[ "$(python3 /app/greet.py Bob 2>/dev/null)" = "Hello, Bob!" ] || ok=0
[ "$(python3 /app/greet.py Ann 2>/dev/null)" = "Hello, Ann!" ] || ok=0
echo $ok > /logs/verifier/reward.txt
