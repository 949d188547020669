#!/bin/sh
python3 -c "import json; print(json.load(open('/app/data.json'))['b']['c'])" > /app/out.txt
