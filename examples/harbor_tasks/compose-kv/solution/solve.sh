#!/bin/sh
python3 - <<'PY'
import json, time, urllib.request
for _ in range(100):
    try:
        value = json.load(urllib.request.urlopen("http://kv:9000/gvisor", timeout=5))["value"]
        break
    except OSError:
        time.sleep(0.2)
open("/app/answer.txt", "w").write(value + "\n")
PY
