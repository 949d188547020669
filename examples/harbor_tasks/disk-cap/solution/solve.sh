#!/bin/sh
if dd if=/dev/zero of=/app/fill bs=1M count=1024 2>/dev/null; then r=uncapped; else r=capped; fi
rm -f /app/fill
echo $r > /app/disk.txt
