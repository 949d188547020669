#!/bin/sh
python3 - <<'PY'
import time, urllib.request
for _ in range(100):
    try:
        body = urllib.request.urlopen("http://web:8080/secret.txt", timeout=5).read().decode()
        break
    except OSError:
        time.sleep(0.2)
open("/app/answer.txt", "w").write(body)
PY
